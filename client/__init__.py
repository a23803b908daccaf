"""fleetfit's Flower ClientApp: node facts -> train on local data -> reply."""
