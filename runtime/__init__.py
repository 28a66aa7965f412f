"""Building an engine's parts from its config, once, at start-up: every config value is read here
and passed down as a value.

- `build.py`: `build_runtime`, the `Runtime` an engine runs on (model runner, decode graphs,
  sampling pipeline, speculator, eviction policy, thread plan).
- `plugins.py`: the config's plugin names resolved to classes, their `plugin_options` validated;
  `registries.py` loads the plugins (built-ins, entry points, config modules) into one registry
  per plugin kind. This is the one place that knows every kind: plugins/ knows none.
- `shard.py`: a model shard (the model, cut to a tensor-parallel rank's part when asked, its KV
  cache and attention backend), and the draft model of speculative decoding.
- `worker.py`: the loop every tensor-parallel rank but 0 runs.

May import: actors/, runner/ and everything below. engine/ and the layers above import it.
"""
