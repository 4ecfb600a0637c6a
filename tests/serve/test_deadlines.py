"""polyserve.serve.deadlines: the watchdog cancels only overdue requests (unit tests), and on a
real host a request waiting for a cold load gets its 504 too."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from polyserve.serve.deadlines import Deadlines
from tests.helpers import until


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_overdue_request_is_cancelled_and_recognized():
    clock = Clock()
    deadlines = Deadlines(5.0, clock=clock)

    async def request():
        task = deadlines.enter()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            return deadlines.expired(task)
        finally:
            deadlines.leave(task)

    async def main():
        slow = asyncio.create_task(request())
        await asyncio.sleep(0)
        clock.now += 4.9
        deadlines.check()
        await asyncio.sleep(0)
        assert not slow.done()
        clock.now += 0.2
        deadlines.check()
        return await slow

    assert asyncio.run(main()) is True
    assert deadlines._due == {} and deadlines._expired == set()


def test_a_cancellation_from_elsewhere_is_not_a_timeout():
    deadlines = Deadlines(5.0, clock=Clock())

    async def request():
        task = deadlines.enter()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            assert not deadlines.expired(task)
            raise
        finally:
            deadlines.leave(task)

    async def main():
        task = asyncio.create_task(request())
        await asyncio.sleep(0)
        task.cancel()  # a client gone, a worker stopping
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


@pytest.mark.gunicorn
def test_a_request_waiting_for_a_cold_load_gets_the_504_and_the_load_goes_on(
    host_factory, tmp_path
):
    """With POLYSERVE_REQUEST_TIMEOUT=1 and an import that waits for the test: two requests
    waiting for that load (one started it, one waits on the other's) are answered 504 in
    JSON naming the setting; the load goes on, and once it is done the next request is
    served by it. Both 504s count as requests and errors, and the space loaded once."""
    validated, go = tmp_path / "validated", tmp_path / "go"
    source = (
        "import os, time\n"
        f"if os.path.exists({str(validated)!r}):  # the worker's import, not the validation's\n"
        f"    while not os.path.exists({str(go)!r}):\n"
        "        time.sleep(0.01)\n"
        f"open({str(validated)!r}, 'w').close()\n"
        "def handle(request):\n"
        "    return 'ok'\n"
    )
    host = host_factory(workers=1, POLYSERVE_REQUEST_TIMEOUT="1")
    assert host.deploy("d/cold", source).status_code == 200
    with ThreadPoolExecutor(2) as pool:
        waiting = list(pool.map(lambda _: host.get("/s/d/cold/"), range(2)))
    assert [r.status_code for r in waiting] == [504, 504], [r.text for r in waiting]
    for r in waiting:
        assert "POLYSERVE_REQUEST_TIMEOUT" in r.json()["error"] and r.json()["space"] == "d/cold"
    go.touch()

    def usage() -> dict:
        return host.get("/_polyserve/usage").json()["spaces"]["d/cold"]

    until(lambda: usage()["loaded"], 30, "the load to finish")
    assert host.get("/s/d/cold/").status_code == 200
    cold = usage()
    assert (cold["requests"], cold["errors"], cold["cold_starts"]) == (3, 2, 1)
