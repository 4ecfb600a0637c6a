"""The smallest space: a handle() function. Deploy with -F module=@hello.py."""


def handle(request):
    name = request.query_params.get("name", "world")
    return {"hello": name, "path": request.url.path}
