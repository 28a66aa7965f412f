"""`cadenza bench serve --workload multi-turn`: the router bench on real 2-replica servers of a tiny
random model. Timings are never asserted."""

from __future__ import annotations

import json
import os

import pytest

from cadenza.bench.cli import main
from cadenza.bench.serving.router_bench import make_multi_turn, metrics_delta

VOCAB = 320  # tests/tiny_models.py
SIZES = ["--conversations", "3", "--system-prompts", "2", "--system-len", "40", "--turns", "2", "--user-len", "4", "8",
         "--output-len", "4", "6"]


def test_router_bench_runs_both_routers_on_their_own_servers(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "router.json"
    code = main(["serve", "--workload", "multi-turn", "--model", str(tiny_model_dir("llama3")), "--dtype", "float32",
                 "--vocab-size", str(VOCAB), *SIZES, "--request-rates", "20", "--max-duration", "60",
                 "--no-quiet-check", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    assert result["routers"] == ["prefix", "round_robin"] and result["data_parallel_size"] == 2
    workload = make_multi_turn(3, 2, 2, 40, (4, 8), (4, 6), seed=0, salt="0", vocab_size=VOCAB)
    assert [r["router"] for r in result["runs"]] == ["prefix", "round_robin"]
    pids = set()
    for run in result["runs"]:
        # Every turn completed exactly once: each slot once on the client, each request routed once.
        assert run["completed"] == run["num_requests"] == 6 and run["failed"] == run["cancelled"] == 0, run["failures"]
        assert sorted(r["index"] for r in run["requests"]) == list(range(6))
        assert sum(run["metrics"]["routed"]) == 6 and len(run["metrics"]["routed"]) == 2
        assert run["output_tokens"] == sum(sum(t) for t in workload.max_tokens) == sum(run["metrics"]["generation_tokens"])
        for c in range(3):
            for t in range(2):
                request = run["requests"][workload.slot(c, t)]
                assert request["status"] == "completed" and request["streamed_tokens"] == workload.max_tokens[c][t]
            # Turn 2's prompt is turn 1's, its answer and the next user message.
            first, second = run["requests"][workload.slot(c, 0)], run["requests"][workload.slot(c, 1)]
            assert second["prompt_tokens"] == first["prompt_tokens"] + first["output_tokens"] + len(workload.user_messages[c][1])
        assert 0 <= run["prefix_hit_rate"] <= 1 and run["metrics"]["prompt_tokens"] == run["prompt_tokens"]
        for key in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "output_tokens_per_s"):
            assert run[key] > 0, key
        assert run["ttft_p50_ms"] <= run["ttft_p99_ms"] and run["quiet"]["summary"].startswith(("quiet", "disturbed"))
        pids.add(run["server_pid"])
    assert set(result["ratios"]) == {"ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "output_tokens_per_s",
                                     "prefix_hit_rate"}
    assert len(pids) == 2 and os.getpid() not in pids
    for pid in pids:  # each arm's server stopped and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    for column in ("router", "TTFT p50 ms", "E2E p99 ms", "output tok/s", "hit rate", "prefix / round_robin"):
        assert column in printed


# --- pieces -------------------------------------------------------------------------------------


def test_the_workload_is_seeded_and_shares_system_prompts():
    a = make_multi_turn(5, 2, 3, 32, (4, 8), (2, 6), seed=1, vocab_size=VOCAB)
    assert a == make_multi_turn(5, 2, 3, 32, (4, 8), (2, 6), seed=1, vocab_size=VOCAB)
    b = make_multi_turn(5, 2, 3, 32, (4, 8), (2, 6), seed=1, salt="1", vocab_size=VOCAB)
    assert a.system_prompts != b.system_prompts and a.num_requests == b.num_requests == 15
    assert a.system_prompt(0) == a.system_prompt(2) != a.system_prompt(1)
    assert all(len(p) == 32 and all(0 <= t < VOCAB for t in p) for p in a.system_prompts)
    assert all(4 <= len(m) <= 8 for turns in a.user_messages for m in turns)
    assert all(2 <= n <= 6 for turns in a.max_tokens for n in turns)
    # Every turn has its own slot, turn by turn, in a shuffled order per round.
    assert sorted(a.slot(c, t) for c in range(5) for t in range(3)) == list(range(15))
    assert all(a.slot(c, t) // 5 == t for c in range(5) for t in range(3))
    assert len({tuple(o) for o in a.order}) > 1
    with pytest.raises(ValueError, match="turns"):
        make_multi_turn(2, 1, 0, 32, (4, 8), (2, 6))


def test_metrics_delta_counts_only_the_timed_run():
    before = {"replicas": [{"routed": 1, "prefix_cached_tokens": 0, "generation_tokens": 4},
                           {"routed": 1, "prefix_cached_tokens": 0, "generation_tokens": 4}], "prompt_tokens": 32}
    after = {"replicas": [{"routed": 4, "prefix_cached_tokens": 96, "generation_tokens": 40},
                          {"routed": 3, "prefix_cached_tokens": 32, "generation_tokens": 20}], "prompt_tokens": 288}
    delta = metrics_delta(before, after)
    assert delta["routed"] == [3, 2] and delta["generation_tokens"] == [36, 16]
    assert delta["prompt_tokens"] == 256 and delta["prefix_hit_rate"] == 0.5


def test_multi_turn_refuses_a_url_and_several_rates(capsys):
    assert main(["serve", "--workload", "multi-turn", "--url", "http://127.0.0.1:1", "--no-quiet-check"]) == 2
    assert "--url" in capsys.readouterr().err
    assert main(["serve", "--workload", "multi-turn", "--request-rates", "1", "2", "--no-quiet-check"]) == 2
    assert "one finite positive" in capsys.readouterr().err
