"""lm-evaluation-harness (`lm-eval`, its `local-completions` model) runs a small
loglikelihood task against `serve` on the demo model to completion, offline: the task's
data is a local JSON file, the tokenizer the demo's own tokenizer.json, and the requests
plain text (`tokenized_requests=False`: what it sends is the completions body with `echo`,
`logprobs: 1`, `max_tokens: 1`).  Each choice's log-likelihood it reports equals the sum of
the continuation tokens' log-softmax recomputed from the model's logits over the rendered
prompt (docs/http-api.md §10.9)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import serve_demo  # noqa: E402

DOCS = [
    {"question": "The sky is", "choices": ["blue", "green"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five", "six"], "answer": 0},
]
TASK = """task: ds4mlx_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def srv():
    with serve_demo(ctx=1024, tokens=8) as s:
        yield s


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _oracle(srv, context: str, continuation: str, ctxlen: int) -> float:
    """The continuation's log-likelihood as the server's echo defines it: the prompt's own
    tokens inside the rendered completion prompt, token i read from position i - 1."""
    from ds4mlx.serve.completions import parse_completion

    text = context + continuation
    ids = srv.tok.encode(parse_completion({"prompt": text}).render())
    own = srv.tok.encode(text)
    start = next(i for i in range(len(ids) - len(own), -1, -1) if ids[i : i + len(own)] == own)
    lsm = _log_softmax(srv.model.logits(ids[: start + len(own)]))
    return float(sum(lsm[start + i - 1, own[i]] for i in range(ctxlen, len(own))))


@pytest.mark.slow
def test_lm_eval_loglikelihood_task_runs_against_serve(srv, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")  # lm-eval[api]
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from ds4mlx.runtime.tokenizer import default_tokenizer_json

    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(k, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    tokdir = tmp_path / "tokenizer"
    tokdir.mkdir()
    shutil.copy(default_tokenizer_json(), tokdir / "tokenizer.json")
    (tokdir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tiny.yaml").write_text(TASK.format(data=tmp_path / "data.jsonl"))

    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": srv.url + "/v1/completions",
            "model": "deepseek-v4-flash",
            "tokenizer": str(tokdir),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": False,
            "max_retries": 1,
        },
        tasks=["ds4mlx_tiny"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    result = out["results"]["ds4mlx_tiny"]
    assert 0.0 <= result["acc,none"] <= 1.0
    hf = AutoTokenizer.from_pretrained(str(tokdir))
    samples = out["samples"]["ds4mlx_tiny"]
    assert sum(len(s["resps"]) for s in samples) == sum(len(d["choices"]) for d in DOCS)
    for s in samples:
        for (context, continuation), [(loglikelihood, _greedy)] in zip(s["arguments"], s["resps"]):
            ctxlen = len(hf(context, add_special_tokens=False)["input_ids"])
            assert loglikelihood == pytest.approx(_oracle(srv, context, continuation, ctxlen), abs=1e-3)
