"""fleetfit's Flower ServerApp: assigns work, aggregates, evaluates, persists."""
