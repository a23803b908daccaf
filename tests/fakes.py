"""A transport that delivers the server's messages straight to the ClientApp, in
process: the ServerApp's loop and the ClientApp called directly with built messages."""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    RecordDict,
)
from flwr.supercore.task_identity import TaskIdentity

from client.app import app as client_app

# Messages built outside a Flower run need a run identity, as Flower's runtime sets.
TaskIdentity.run_id = 1
TaskIdentity.node_id = 0
TaskIdentity.task_id = 0


class DirectTransport:
    def __init__(
        self,
        num_nodes: int,
        tamper: Callable[[int, Message], Message] | None = None,
        fail: set[int] | None = None,
    ) -> None:
        self.node_config = {
            1000 + i: {"partition-id": i, "num-partitions": num_nodes}
            for i in range(num_nodes)
        }
        self.tamper = tamper
        self.fail = fail or set()
        self.sent: list[tuple[int, int]] = []  # (round, node)

    def _context(self, node_id: int) -> Context:
        return Context(
            run_id=1,
            node_id=node_id,
            node_config=self.node_config[node_id],
            state=RecordDict(),
            run_config={},
        )

    def _deliver(self, msg: Message) -> Message:
        node_id = msg.metadata.dst_node_id
        reply = client_app(msg, self._context(node_id))
        if self.tamper is not None:
            reply = self.tamper(node_id, reply)
        return reply

    def node_ids(self) -> list[int]:
        return sorted(self.node_config)

    def wait_for_nodes(self, minimum: int, timeout_s: float) -> list[int]:
        if len(self.node_config) < minimum:
            raise TimeoutError(f"only {len(self.node_config)} of {minimum} nodes")
        return self.node_ids()

    def query(self, node_ids: list[int], timeout_s: float) -> dict[int, Message]:
        out = {}
        for n in node_ids:
            msg = Message(
                RecordDict({"config": ConfigRecord({})}), n, MessageType.QUERY
            )
            out[n] = client_app(msg, self._context(n))
        return out

    def train(
        self,
        instructions: dict[int, tuple[ArrayRecord, ConfigRecord]],
        server_round: int,
        timeout_s: float,
    ) -> list[Message]:
        replies = []
        for n, (arrays, config) in instructions.items():
            self.sent.append((server_round, n))
            if n in self.fail:
                continue  # no reply: a node that died or timed out
            msg = Message(
                RecordDict({"arrays": arrays, "config": config}),
                n,
                MessageType.TRAIN,
                group_id=str(server_round),
            )
            replies.append(self._deliver(msg))
        return replies
