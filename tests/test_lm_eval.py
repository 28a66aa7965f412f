"""lm-evaluation-harness against `cadenza serve`, end to end: its `local-completions` backend
scores a loglikelihood task (echo + logprobs on /v1/completions) and a generate-until task, and
gets what the same harness computes with transformers (`--model hf`, float32) on the same weights:
the same accuracies, each choice's log-likelihood and each generated text.

The tasks are local files (tests/data/lm_eval: a task YAML and a jsonl each), run with no hub
access; lm_eval runs in processes of its own, the transformers one beside the served one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import httpx
from server_process import running_server

TASKS_DIR = Path(__file__).parent / "data" / "lm_eval"
TASKS = "cadenza_choice,cadenza_generate"
TIMEOUT = 300  # seconds for one lm_eval run; each takes about 30 here


@contextmanager
def lm_eval(args: list[str], output: Path, env: dict[str, str]):
    """Start `lm_eval` (from the tasks' directory: their data files are relative to it); yields
    a function that waits for it and returns its results. Stopped by its process group on failure."""
    command = [sys.executable, "-m", "lm_eval", *args, "--tasks", TASKS, "--include_path", ".",
               "--output_path", str(output), "--log_samples"]  # fmt: skip
    log = open(output.with_suffix(".log"), "w")
    process = subprocess.Popen(command, cwd=TASKS_DIR, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait() -> dict:
        code = process.wait(TIMEOUT)
        text = output.with_suffix(".log").read_text()
        assert code == 0, f"lm_eval exited with {code}:\n{text[-4000:]}"
        return _results(output)

    try:
        yield wait
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        log.close()


def _results(output: Path) -> dict:
    """{task: (metrics, samples by doc id)} from lm_eval's --output_path."""
    (results,) = output.rglob("results_*.json")
    metrics = json.loads(results.read_text())["results"]
    out = {}
    for task in TASKS.split(","):
        (samples,) = output.rglob(f"samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in samples.read_text().splitlines()]
        values = {k: v for k, v in metrics[task].items() if "," in k and "stderr" not in k}
        out[task] = (values, {row["doc_id"]: row for row in rows})
    return out


def test_lm_eval_scores_cadenza_as_it_scores_transformers(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama3")
    env = {
        **os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "TOKENIZERS_PARALLELISM": "false",
    }  # fmt: skip
    hf_args = ["--model", "hf", "--model_args", f"pretrained={model_dir},dtype=float32", "--device", "cpu", "--batch_size", "1"]
    with lm_eval(hf_args, tmp_path / "hf_out", env) as hf_results, running_server(model_dir) as server:
        name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        served_args = [
            "--model", "local-completions",
            "--model_args", f"model={name},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                            f"tokenizer={model_dir},num_concurrent=1,max_retries=1",
            "--batch_size", "4",  # 4 prompts a request
        ]  # fmt: skip
        with lm_eval(served_args, tmp_path / "served_out", env) as served_results:
            served = served_results()
        hf = hf_results()
        assert not [line for line in server.lines if "Traceback" in line or '"level": "error"' in line]
    worst = 0.0
    for task in TASKS.split(","):
        (served_metrics, served_samples), (hf_metrics, hf_samples) = served[task], hf[task]
        print(f"\n{task}: cadenza {served_metrics}, transformers {hf_metrics}")
        assert served_metrics == hf_metrics and served_metrics
        assert served_samples.keys() == hf_samples.keys() and served_samples
        for doc_id, hf_sample in hf_samples.items():
            got, want = served_samples[doc_id]["filtered_resps"], hf_sample["filtered_resps"]
            if task == "cadenza_choice":  # (log-likelihood, is greedy) per choice
                assert [g for _, g in got] == [g for _, g in want]
                worst = max(worst, *(abs(float(a) - float(b)) for (a, _), (b, _) in zip(got, want)))
            else:
                assert got == want
    print(f"choices' log-likelihoods: at most {worst:.1e} from transformers'")
    assert worst < 1e-3
