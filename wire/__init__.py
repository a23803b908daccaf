"""The wire contract between fleetfit's ServerApp and ClientApp, owned by neither.

- ``wire.keys``: the record names and every key a message carries;
- ``wire.flat``: the one parser of Flower's flat kebab-case keys into a frozen
  dataclass (the run config, the train instruction), sub-configs flattened and
  comma-separated lists read once into typed tuples;
- ``wire.shape``: the run's shape (``RunShape``: workload, local steps, lr, seed,
  split, batch and sequence), the one record of it from the simulation settings to
  the train instruction;
- ``wire.instruction``: what a client is asked to do (``TrainInstruction``) and the
  rule that picks how its peak is measured;
- ``wire.facts``: what a node says of itself in reply to a query (``NodeFacts``) and
  the fleet description's per-partition lists;
- ``wire.reply``: what a client answers (``TrainReply``, ``EvalReply``), written and
  read in one place;
- ``wire.windows``: which blocks a model is assigned over and which state-dict keys a
  window trains (the client freezes by it, the server checks replies against it).

``client`` and ``server`` import this package and nothing of each other. Everything but
``wire.windows`` (torch) imports without torch.
"""
