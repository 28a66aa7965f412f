"""config.json files of real model shapes, for `model.load_format: dummy` (random weights)."""
