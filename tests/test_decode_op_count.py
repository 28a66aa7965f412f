"""The launches of one decode step on the GPU path, counted on the CPU and held (issue 36).

The model runs Llama-3.2-1B's layer shape (two of its layers, dummy weights, bfloat16) with the
`triton` attention backend's kernels and the layer ops (kernels/triton/layer_ops.py) under Triton's
interpreter, in a child process so the interpreter is on before triton loads. A dispatch mode counts
every aten op that would launch a kernel (views and bare allocations do not), and each Triton launch
counts once (the torch work the interpreter does inside a launch is not counted). Per layer: four
products, two fused add + RMSNorms, one rotary, one SiLU x up, the KV write and the split decode
with its combine: 11; the step adds the embedding and the final norm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

LAYERS = 2
PER_LAYER = 11

COUNT_STEP = textwrap.dedent("""
    import json, os, sys
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    import triton.runtime.interpreter as interpreter
    from cadenza.bench.offline.model_step import _chunk
    from cadenza.config.loader import load_config
    from cadenza.llm import LLM
    from cadenza.models.dummy import read_dummy_config
    from cadenza.sampling_params import SamplingParams
    from cadenza.threads.compute_thread import run_sync

    directory, layers = sys.argv[1], int(sys.argv[2])
    raw, _ = read_dummy_config("llama-3.2-1b")
    raw["num_hidden_layers"] = layers
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(raw, f)

    class Launches(TorchDispatchMode):
        '''aten ops that launch a kernel (not views, not bare allocations), and Triton launches.'''
        ALLOCATIONS = (torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided)

        def __init__(self):
            super().__init__()
            self.ops, self.inside_triton, self.on = [], 0, False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
            if self.on and not self.inside_triton and not view and func.overloadpacket not in self.ALLOCATIONS:
                self.ops.append(func.overloadpacket.__name__)
            return out

    launches = Launches()
    run = interpreter.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        launches.inside_triton += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            launches.inside_triton -= 1
            if launches.on and not launches.inside_triton:
                launches.ops.append("triton:" + self.fn.__name__)

    interpreter.InterpretedFunction.run = counted_run
    overrides = {"model.path": directory, "model.load_format": "dummy", "model.dtype": "bfloat16",
                 "model.cpu_kernels": "off", "model.max_model_len": 256, "cache.block_size": 16,
                 "attention_backend": "triton", "plugin_options": {"triton": {"implementation": "triton"}}}
    with LLM(config=load_config(None, overrides=overrides, env={})) as llm:
        runner = llm.runtime.runner
        prompt = list(range(3, 20))
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

        def decode_step():
            runner.execute([_chunk("a", prompt, 0, [0, 1], params, prompt)])
            inputs = runner._packer.pack([_chunk("a", [9], len(prompt), [0, 1], params, prompt + [9])], [0])
            launches.on = True
            with launches:
                runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, runner.backend)
            launches.on = False

        run_sync(decode_step)
        uses_layer_ops = runner.model.layer_ops is not None
    print(json.dumps({"ops": launches.ops, "layer_ops": uses_layer_ops}))
""")


def test_a_decode_step_of_the_1b_shape_launches_about_ten_kernels_a_layer(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "CADENZA_LOGGING__LEVEL": "warning"}
    done = subprocess.run([sys.executable, "-c", COUNT_STEP, str(tmp_path), str(LAYERS)], capture_output=True,
                          text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    ops = result["ops"]
    assert result["layer_ops"], "the Triton backend's model should run the layer ops"
    assert len(ops) == 2 + PER_LAYER * LAYERS, ops
    assert ops.count("linear") == 4 * LAYERS and ops.count("triton:_add_rms_norm_kernel") == 2 * LAYERS + 1
    assert ops.count("triton:_rotary_kernel") == LAYERS and ops.count("triton:_silu_mul_kernel") == LAYERS
    # The elementwise torch work the layer ops replace appears nowhere.
    assert not {"mul", "add", "add_", "pow", "mean", "rsqrt", "silu", "neg", "cat", "index_select"} & set(ops), ops
