"""A Flower ``Grid`` that hands messages straight to ClientApps, in process.

It drives the real ``FlowerTransport`` (and Flower's own strategies) without a
SuperLink: each node has its own ClientApp, node config and ``context.state``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp

from tests import fakes  # noqa: F401  (sets Flower's task identity)


class FakeGrid:
    def __init__(
        self,
        nodes: dict[int, tuple[ClientApp, dict[str, Any]]],
        *,
        run_config: dict[str, Any] | None = None,
        silent: set[int] | None = None,
        tamper: Callable[[int, Message], Message] | None = None,
    ) -> None:
        self.nodes = nodes
        self.run_config = dict(run_config or {})
        self.silent = silent or set()  # nodes that answer queries, then die
        self.tamper = tamper
        self.state = {n: RecordDict() for n in nodes}
        self.log: list[tuple[str, int]] = []  # (message type, node)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        self._ready = getattr(self, "_ready", {})
        ids = []
        for msg in messages:
            reply = self._deliver(msg)
            mid = f"m{len(self.log)}"
            ids.append(mid)
            if reply is not None:
                reply.metadata.__dict__["_reply_to_message_id"] = mid
                self._ready[mid] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self._ready.pop(m) for m in list(message_ids) if m in self._ready]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        replies = [self._deliver(m) for m in messages]
        return [r for r in replies if r is not None]

    def _deliver(self, msg: Message) -> Message | None:
        node_id = msg.metadata.dst_node_id
        self.log.append((msg.metadata.message_type, node_id))
        if node_id in self.silent and msg.metadata.message_type != "query":
            return None
        app, node_config = self.nodes[node_id]
        ctx = Context(
            run_id=1,
            node_id=node_id,
            node_config=node_config,
            state=self.state[node_id],
            run_config=self.run_config,
        )
        try:
            reply = app(msg, ctx)
        except Exception as e:  # as Flower's runtime does: an error reply
            reply = Message(Error(0, f"{type(e).__name__}: {e}"), reply_to=msg)
        if self.tamper is not None:
            reply = self.tamper(node_id, reply)
        return reply
