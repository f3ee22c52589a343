"""Holding an id on the core (``id_locks``) against a stand-in for the core's answers."""

from __future__ import annotations

from typing import Any

import pytest

from tridentmq_shared import id_locks
from tridentmq_shared.link.errors import LinkRequestError
from tridentmq_shared.link.ops import ErrorCode


class FakeLink:
    """Answers each CREATE_QUEUE with the next of ``answers`` (the last one again once they run out)."""

    def __init__(self, *answers: dict[str, Any]) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str, str]] = []

    async def create_queue(self, name: str, address: str | None = None, **options: Any) -> dict[str, Any]:
        assert options == {"durable": False, "temporary": True}
        self.calls.append(("create", name))
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    async def delete_queue(self, name: str) -> None:
        self.calls.append(("delete", name))


async def test_a_free_id_is_held_at_once() -> None:
    link = FakeLink({"created": True})
    assert await id_locks.hold(link, "l")
    assert link.calls == [("create", "l")]


async def test_an_id_held_elsewhere_is_not_taken_and_leaves_no_queue_of_ours() -> None:
    link = FakeLink({"created": True, "elsewhere": True})
    assert not await id_locks.hold(link, "l", wait_s=0.02, retry_s=0.005)
    assert link.calls[-1] == ("delete", "l")  # ours goes even on the last try
    assert link.calls.count(("create", "l")) == link.calls.count(("delete", "l")) >= 2


async def test_an_id_coming_free_while_waiting_is_held() -> None:
    link = FakeLink({"created": False}, {"created": False}, {"created": True})
    assert await id_locks.hold(link, "l", wait_s=5, retry_s=0.001)
    assert link.calls == [("create", "l")] * 3


async def test_an_id_held_here_is_refused_after_the_wait() -> None:
    link = FakeLink({"created": False})
    assert not await id_locks.hold(link, "l", wait_s=0.01, retry_s=0.002)
    assert ("delete", "l") not in link.calls  # the queue is the holder's


async def test_the_cores_refusal_is_raised_and_a_release_of_a_gone_link_is_quiet() -> None:
    class Refusing(FakeLink):
        async def create_queue(self, name: str, address: str | None = None, **options: Any) -> dict[str, Any]:
            raise LinkRequestError(ErrorCode.FORBIDDEN, "no")

        async def delete_queue(self, name: str) -> None:
            raise LinkRequestError(ErrorCode.EOF, "gone")

    with pytest.raises(LinkRequestError):
        await id_locks.hold(Refusing(), "l")
    await id_locks.release(Refusing(), "l")
