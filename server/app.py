"""fleetfit's ServerApp (Flower Message API): query nodes, train, aggregate, evaluate,
save. ``app`` is the component that ``flwr run .`` starts; ``make_app(overrides)``
builds one whose settings override the run config (used by ``fleetfit simulate``,
since Flower's in-process simulation has no run config of its own).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    RecordDict,
)
from flwr.serverapp import Grid, ServerApp

from server.config import ServerConfig
from server.loop import Federation
from wire import keys

log = logging.getLogger(__name__)


def make_app(overrides: dict[str, Any] | None = None) -> ServerApp:
    """A ServerApp whose settings are the run config updated with ``overrides``."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        run_config = {**dict(context.run_config), **(overrides or {})}
        cfg = ServerConfig.from_run_config(run_config)
        Federation(cfg, FlowerTransport(grid, query_config=cfg.fleet.to_query())).run()

    return server_app


class FlowerTransport:
    """The federation's view of Flower's Grid: nodes, queries and train rounds."""

    def __init__(self, grid: Grid, query_config: dict[str, Any] | None = None) -> None:
        self.grid = grid
        self.query_config = dict(query_config or {})  # the fleet description

    def node_ids(self) -> list[int]:
        return sorted(self.grid.get_node_ids())

    def wait_for_nodes(self, minimum: int, timeout_s: float) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while True:
            nodes = self.node_ids()
            if len(nodes) >= minimum:
                return nodes
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(nodes)} of the {minimum} nodes that min-nodes asks for "
                    f"connected within {timeout_s:.0f} s: start more SuperNodes or lower "
                    "min-nodes"
                )
            time.sleep(1.0)

    def query(self, node_ids: list[int], timeout_s: float) -> dict[int, Message]:
        msgs = [
            Message(
                RecordDict({keys.CONFIG: ConfigRecord(dict(self.query_config))}),
                node_id,
                MessageType.QUERY,
            )
            for node_id in node_ids
        ]
        return {
            m.metadata.src_node_id: m
            for m in self.grid.send_and_receive(msgs, timeout=timeout_s)
        }

    def train(
        self,
        instructions: dict[int, tuple[ArrayRecord, ConfigRecord]],
        server_round: int,
        timeout_s: float,
    ) -> list[Message]:
        msgs = [
            Message(
                RecordDict({keys.ARRAYS: arrays, keys.CONFIG: config}),
                node_id,
                MessageType.TRAIN,
                group_id=str(server_round),
            )
            for node_id, (arrays, config) in instructions.items()
        ]
        # What arrived by the deadline: a dead or slow node costs the round its
        # update, never the round itself. Waiting also ends early when every node
        # still owing a reply has left the federation.
        pending = dict(zip(self.grid.push_messages(msgs), instructions))
        replies: list[Message] = []
        deadline = time.monotonic() + timeout_s
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                if pending.pop(reply.metadata.reply_to_message_id, None) is not None:
                    replies.append(reply)
            if not pending or time.monotonic() > deadline:
                break
            live = set(self.grid.get_node_ids())
            if not live & set(pending.values()):
                log.warning(
                    "round %d: node(s) %s left without replying",
                    server_round,
                    sorted(pending.values()),
                )
                break
            time.sleep(0.5)
        return replies


app = make_app()
