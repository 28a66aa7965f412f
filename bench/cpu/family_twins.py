"""`python -m cadenza.bench.cpu.family_twins`: each dense family's decode against a Llama of its shape.

A family is options of one decoder (models/families.py), and the fused layer kernel runs the options
inside a layer, so a family should decode as fast as a Llama of the same sizes. For each family's
shipped shape (config/shapes/: gemma-3-1b, phi-4-mini, smollm3-3b, granite-3.3-2b), cut to its first
`--layers` decoder layers, and its Llama twin (model_type llama, the same sizes, vocabulary and tied
embeddings): random weights (`load_format: dummy`) quantized on load to Q8_0 blocks
(`quantization: int8`), bfloat16, in this one process. Decode at batch 1 is (time of 1 + 32 new
tokens - time of 1) / 32 after a 16-token prompt, greedy; family and twin alternate for `--rounds`
rounds on a quiet machine (bench/common/quiet.py), the best of each kept. Prints tok/s and the
family's ratio to its twin (the issue's target: within 5%).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from cadenza.bench.common.quiet import run_quietly

FAMILIES = ("gemma-3-1b", "phi-4-mini", "smollm3-3b", "granite-3.3-2b")
# What a Llama twin keeps of a family's config: its sizes.
_TWIN_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
              "tie_word_embeddings", "rms_norm_eps", "max_position_embeddings", "bos_token_id", "eos_token_id")
_PROMPT, _NEW = [5] * 16, 32


def configs(shape: str, layers: int, directory: Path) -> tuple[Path, Path]:
    """(the family's config, its Llama twin's), each cut to `layers` layers, written into `directory`."""
    source = Path(__file__).resolve().parents[2] / "config" / "shapes" / f"{shape}.json"
    family = json.loads(source.read_text())
    family["num_hidden_layers"] = layers
    for key in ("layer_types", "no_rope_layers"):  # per-layer lists follow the cut
        if key in family:
            family[key] = family[key][:layers]
    twin = {key: family[key] for key in _TWIN_KEYS if key in family}
    twin.update(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=layers,
                rope_theta=family.get("rope_theta", 10000.0))
    paths = []
    for name, config in ((shape, family), (f"{shape}-llama-twin", twin)):
        path = directory / name / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config))
        paths.append(path)
    return paths[0], paths[1]


def decode_rate(llm) -> float:
    """Batch-1 decode tok/s: (1 + 32 new tokens - 1 new token) over 32."""
    from cadenza import SamplingParams

    def run(n: int) -> float:
        started = time.perf_counter()
        llm.generate([_PROMPT], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - started

    run(_NEW + 1)  # warm-up
    return _NEW / (run(_NEW + 1) - run(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--layers", type=int, default=8, help="decoder layers kept of each shape (real layer sizes)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    from cadenza import LLM

    print("family           layers  family tok/s  llama twin tok/s  ratio  machine")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.families:
            family_path, twin_path = configs(shape, args.layers, Path(tmp))
            engines = {name: LLM(str(path), load_format="dummy", quantization="int8", dtype="bfloat16",
                                 max_model_len=512, **{"logging.level": "warning"})
                       for name, path in (("family", family_path), ("twin", twin_path))}  # fmt: skip
            best = {"family": 0.0, "twin": 0.0}
            reports = []
            try:
                for _ in range(args.rounds):
                    for name, llm in engines.items():
                        rate, report = run_quietly(lambda llm=llm: decode_rate(llm), on_compute_thread=False)
                        best[name] = max(best[name], rate)
                        reports.append(report)
            finally:
                for llm in engines.values():
                    llm.close()
            quiet = max(reports, key=lambda r: r.other_share or 0.0).describe()
            print(f"{shape:<16} {args.layers:>6}  {best['family']:>12.1f}  {best['twin']:>16.1f}  "
                  f"{best['family'] / best['twin']:>5.2f}  {quiet}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
