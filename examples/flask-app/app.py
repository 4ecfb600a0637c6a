"""A plain Flask app, served by polyserve unchanged: deploy this folder as a space."""

from flask import Flask, jsonify, request, url_for

app = Flask(__name__)


@app.get("/")
def index():
    # url_for knows the mount point: under polyserve it answers /s/owner/name/hello/world.
    return jsonify(hello=url_for("hello", name="world"), docs=url_for("index"))


@app.get("/hello/<name>")
def hello(name: str):
    return jsonify(greeting=f"hello, {name}", lang=request.args.get("lang", "en"))


@app.post("/echo")
def echo():
    return jsonify(got=request.get_json(force=True))


@app.get("/boom")
def boom():
    raise RuntimeError("this route fails on purpose")


@app.errorhandler(404)
def not_found(error):
    return jsonify(error="no such page", path=request.path), 404
