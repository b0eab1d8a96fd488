"""Logprobs from the engine equal log_softmax of a direct forward's logits, after penalties and temperature."""
import pytest
import torch

from k3.model.sampling import SamplingParams, apply_penalties
from k3.serve.engine import Engine

NO_EOS = -1


def _direct(model, ids):
    """Logits [T, V] of one full forward, no cache."""
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]


def _want(model, r, temperature, top):
    """Per sampled token: (its logprob, the top alternatives) from direct forwards over prompt + output so far."""
    out = []
    seq = list(r.prompt_ids)
    counts = torch.bincount(torch.tensor(seq), minlength=model.config.vocab_size)
    out_counts = torch.zeros_like(counts)
    for tok in r.output_ids:
        logits = _direct(model, seq)[-1]
        if r.params.penalised:
            logits = apply_penalties(logits, counts, r.params, out_counts)
        lp = torch.log_softmax(logits.double() / (temperature or 1.0), -1)
        vals, idx = lp.topk(top)
        out.append((lp[tok].item(), idx.tolist(), vals.tolist()))
        seq.append(tok)
        counts[tok] += 1
        out_counts[tok] += 1
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=6, temperature=0),
    SamplingParams(max_tokens=6, temperature=0.7, seed=3),
    SamplingParams(max_tokens=6, temperature=1.3, top_k=20, top_p=0.9, seed=4, repetition_penalty=1.4,
                   frequency_penalty=0.5),
], ids=["greedy", "temperature", "penalties-topk-topp"])
def test_sampled_token_logprobs_equal_a_direct_forward(tiny_model, params):
    prompts = [list(range(20, 45)), list(range(60, 67)), list(range(100, 140))]
    eng = Engine(tiny_model, max_batch=3, prefill_chunk=16, eos_id=NO_EOS)
    reqs = eng.generate(prompts, params, logprobs=5)
    for r in reqs:
        assert len(r.output_logprobs) == len(r.output_ids) == 6
        for got, (lp, idx, vals) in zip(r.output_logprobs, _want(tiny_model, r, params.temperature, 5)):
            assert abs(got.logprob - lp) < 1e-4
            assert [i for i, _ in got.top] == idx
            assert all(abs(v - w) < 1e-4 for (_, v), w in zip(got.top, vals))
            assert [v for _, v in got.top] == sorted((v for _, v in got.top), reverse=True)
    # asking for logprobs changes nothing else
    plain = Engine(tiny_model, max_batch=3, prefill_chunk=16, eos_id=NO_EOS).generate(prompts, params)
    assert [r.output_ids for r in plain] == [r.output_ids for r in reqs]


def test_prompt_logprobs_equal_a_direct_forward_chunked_and_packed(tiny_model):
    prompts = [list(range(20, 57)), list(range(60, 67)), [300], list(range(100, 110))]
    for chunk in (8, 64):  # pieces of 8 (chunked); 64: the short prompts packed into one row
        eng = Engine(tiny_model, max_batch=4, prefill_chunk=chunk, eos_id=NO_EOS)
        reqs = eng.generate(prompts, SamplingParams(max_tokens=2, temperature=0), prompt_logprobs=3)
        for r, ids in zip(reqs, prompts):
            assert len(r.prompt_logprob_list) == len(ids)
            first = r.prompt_logprob_list[0]
            assert first.token_id == ids[0] and first.logprob is None
            lp = torch.log_softmax(_direct(tiny_model, ids).double(), -1)
            for t in range(1, len(ids)):
                e = r.prompt_logprob_list[t]
                assert e.token_id == ids[t] and abs(e.logprob - lp[t - 1, ids[t]].item()) < 1e-4
                assert [i for i, _ in e.top] == lp[t - 1].topk(3).indices.tolist()


def test_prompt_only_scores_and_generates_nothing(tiny_model):
    ids = list(range(30, 50))
    eng = Engine(tiny_model, max_batch=2, prefill_chunk=8, eos_id=NO_EOS)
    r = eng.generate([ids], SamplingParams(max_tokens=1, temperature=0.5), prompt_logprobs=0, prompt_only=True)[0]
    assert r.finish_reason == "length" and r.output_ids == [] and len(r.prompt_logprob_list) == len(ids)
    lp = torch.log_softmax(_direct(tiny_model, ids).double() / 0.5, -1)  # at the request's temperature
    assert all(abs(e.logprob - lp[t - 1, ids[t]].item()) < 1e-4 for t, e in enumerate(r.prompt_logprob_list) if t)
    with pytest.raises(ValueError, match="logprobs"):
        eng.submit(ids, logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        eng.submit(ids, prompt_logprobs=True)


def test_prompt_logprobs_bypass_the_prefix_cache(tiny_model):
    ids = list(range(20, 80))
    eng = Engine(tiny_model, max_batch=2, prefill_chunk=16, prefix_block=16, prefix_cache_bytes=1 << 30,
                 eos_id=NO_EOS)
    eng.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    r = eng.generate([ids + [5]], SamplingParams(max_tokens=1, temperature=0), prompt_logprobs=0)[0]
    assert r.cached_tokens == 0 and len(r.prompt_logprob_list) == len(ids) + 1
    assert eng.generate([ids + [5]], SamplingParams(max_tokens=1, temperature=0))[0].cached_tokens == 60
