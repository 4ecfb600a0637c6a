"""Unit tests of polyserve.deadlines: the watchdog cancels only overdue requests."""

import asyncio

import pytest

from polyserve.deadlines import Deadlines


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
