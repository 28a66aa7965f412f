"""`python -m cadenza.bench.cpu.kernel_rates`: how fast each GGUF type's products stream its weights.

One weight of a real shape (by default Llama-3.2-1B's ffn_down, 2048 x 8192) in each type the
kernels read, random blocks with sane scales, in as many copies as fill 512 MiB (beyond the caches),
multiplied by one activation row (batch-1 decode) or a few, in the file's layout and packed; each
figure the copies' bytes over the best time of a pass over them all, and that as a fraction of the memory's read rate measured in the same run (the kernels'
`stream_read`, every thread streaming). A decode step reads its weights once, so at sizes beyond
the caches a type's packed rate against the read rate is how close its decode can come to the
bandwidth limit. Run it once per CPU kind (`CADENZA_CPU=avx2 ...`); the machine is checked quiet.

    python -m cadenza.bench.cpu.kernel_rates --threads 2 --rows 1 4
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from cadenza.bench.common.device import best_seconds

# Per type: (values a block, bytes a block, offsets of its float16 scales and their ranges). Every
# other byte is random quant bits, a valid block of the type.
TYPES: dict[str, tuple[int, tuple[tuple[int, float, float], ...]]] = {
    "Q8_0": (8, ((0, -0.05, 0.05),)),
    "Q4_0": (2, ((0, -0.05, 0.05),)),
    "Q4_1": (3, ((0, 0.001, 0.02), (2, -0.1, 0.1))),
    "Q5_0": (6, ((0, -0.025, 0.025),)),
    "Q5_1": (7, ((0, 0.001, 0.02), (2, -0.1, 0.1))),
    "Q2_K": (10, ((80, 0.001, 0.005), (82, 0.001, 0.005))),
    "Q3_K": (11, ((108, 0.001, 0.005),)),
    "Q4_K": (12, ((0, 0.0005, 0.002), (2, 0.0005, 0.002))),
    "Q5_K": (13, ((0, 0.0005, 0.002), (2, 0.0005, 0.002))),
    "Q6_K": (14, ((208, 0.0002, 0.001),)),
    "IQ4_NL": (20, ((0, -0.05, 0.05),)),
    "IQ4_XS": (23, ((0, 0.0005, 0.002),)),
    "MXFP4": (39, ()),  # its one scale is an E8M0 byte: `_EXPONENTS`
}
# Types whose scale is a power-of-two exponent byte (offset, lowest, highest): random bytes would
# include denormal and infinite scales; these give values of a trained model's size (2^-10..2^-4).
_EXPONENTS = {39: (0, 118, 124)}


def random_weight(qtype: int, scales, rows: int, cols: int, rng: np.random.Generator) -> torch.Tensor:
    import gguf

    elems, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    blocks = rng.integers(0, 256, size=(rows, cols // elems, size), dtype=np.uint8)
    for offset, low, high in scales:
        values = rng.uniform(low, high, size=blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset : offset + 2] = values.view(np.uint8).reshape(*blocks.shape[:2], 2)
    if qtype in _EXPONENTS:
        offset, low, high = _EXPONENTS[qtype]
        blocks[:, :, offset] = rng.integers(low, high + 1, size=blocks.shape[:2], dtype=np.uint8)
    return torch.from_numpy(blocks.reshape(rows, -1))


def measure(kernels, shape: tuple[int, int], row_counts: list[int], seed: int = 0, read_bytes: int = 512 << 20,
            types: list[str] | None = None) -> dict:
    """{"rates": {type: {layout: {rows: bytes/s}}}, "read_rate": bytes/s}, all in one run (`types`: these
    of TYPES only)."""
    rng = np.random.default_rng(seed)
    read = torch.ones(read_bytes // 4)
    read_rate = read.numel() * 4 / best_seconds(lambda: kernels.stream_read(read), min_reps=5)
    out_features, in_features = shape
    rates: dict[str, dict[str, dict[int, float]]] = {}
    for name, (qtype, scales) in TYPES.items():
        if types is not None and name not in types:
            continue
        w = random_weight(qtype, scales, out_features, in_features, rng)
        layouts = {"file": (w, qtype)}
        if kernels.quant_packs(qtype):
            layouts["packed"] = (kernels.quant_pack(w, qtype), qtype + 256)
        rates[name] = {}
        for layout, (weight, type_id) in layouts.items():
            # Copies enough to pass the caches (a server CPU's L3 holds one such weight many times
            # over): a pass over all of them reads from memory, as a decode step of a 1B-8B model does.
            copies = [weight] + [weight.clone() for _ in range(read_bytes // weight.numel() - 1)]
            rates[name][layout] = {}
            for rows in row_counts:
                x = torch.randn(rows, in_features)

                def one_pass() -> None:
                    for copy in copies:
                        kernels.quant_linear(x, copy, type_id, None)

                rates[name][layout][rows] = len(copies) * weight.numel() / best_seconds(one_pass)
            copies = []  # the copies go before the next type's are made
    return {"read_rate": read_rate, "rates": rates}


def report(result: dict, row_counts: list[int]) -> str:
    read = result["read_rate"]
    lines = [f"memory read rate (stream_read): {read / 1e9:.1f} GB/s",
             "type     layout  " + "  ".join(f"{r:>2} row(s): GB/s (of read)" for r in row_counts)]  # fmt: skip
    for name, layouts in result["rates"].items():
        for layout, by_rows in layouts.items():
            cells = "  ".join(f"{by_rows[r] / 1e9:>16.1f} ({by_rows[r] / read:4.0%})" for r in row_counts)
            lines.append(f"{name:<8} {layout:<7} {cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="activation rows a product")
    parser.add_argument("--shape", type=int, nargs=2, default=[2048, 8192], metavar=("OUT", "IN"))
    parser.add_argument("--types", nargs="+", choices=list(TYPES), default=None, help="these types only (default: all)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    from cadenza.bench.common.quiet import QuietPolicy, describe_machine, run_quietly
    from cadenza.kernels.cpu import loader

    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = loader.configure("on")
    result, quiet = run_quietly(lambda: measure(kernels, tuple(args.shape), args.rows, types=args.types), QuietPolicy(max_wait_seconds=120),
                                on_compute_thread=False)
    print(f"{describe_machine()}; kernels {kernels.packed_path()} ({loader.isa()}); {torch.get_num_threads()} threads; "
          f"weight {args.shape[0]} x {args.shape[1]}; {quiet.describe()}")  # fmt: skip
    print(report(result, args.rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "quiet": quiet.as_dict(), "isa": loader.isa(), "threads": torch.get_num_threads()}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
