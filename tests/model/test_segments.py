"""Packed documents: a row of several documents with doc_ids gives each document the logits it gets alone."""
import pytest
import torch

from k3.config import get_config
from k3.model.transformer import K3Model


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = K3Model(get_config("tiny")).double().eval()
    with torch.no_grad():  # livelier than the init so that leaks across a boundary show
        for name, p in m.named_parameters():
            if p.dim() >= 2 and "attnres" not in name:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    return m


@pytest.mark.parametrize("lengths", [[5, 1, 70, 9], [80], [1, 1, 1]])
def test_packed_row_equals_each_document_alone(model, lengths):
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 512, (1, n), generator=g) for n in lengths]
    row = torch.cat(docs, 1)
    doc_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], 1)
    with torch.no_grad():
        packed = model(row, doc_ids=doc_ids)
        alone = torch.cat([model(d) for d in docs], 1)
    torch.testing.assert_close(packed, alone, atol=1e-10, rtol=1e-10)


def test_rows_of_a_batch_and_repeated_labels(model):
    """Two rows packed differently; a label that comes back later in a row is a new document."""
    g = torch.Generator().manual_seed(2)
    a, b, c, d = (torch.randint(0, 512, (1, n), generator=g) for n in (7, 12, 4, 15))
    rows = torch.cat([torch.cat([a, b], 1), torch.cat([c, d], 1)])
    doc_ids = torch.tensor([[3] * 7 + [4] * 12, [3] * 4 + [9] * 15])  # labels are per row
    one_label = torch.full((1, 19), 3)
    with torch.no_grad():
        packed = model(rows, doc_ids=doc_ids)
        alone = [torch.cat([model(a), model(b)], 1), torch.cat([model(c), model(d)], 1)]
        torch.testing.assert_close(packed, torch.cat(alone), atol=1e-10, rtol=1e-10)
        one = model(rows[:1], doc_ids=one_label)  # one label throughout: one document, the plain forward
        torch.testing.assert_close(one, model(rows[:1]), atol=1e-10, rtol=1e-10)
        back = torch.tensor([[0] * 5 + [1] * 6 + [0] * 8])  # label 0 returns after 1: a third document
        r = rows[:1]
        torch.testing.assert_close(model(r, doc_ids=back),
                                   torch.cat([model(r[:, :5]), model(r[:, 5:11]), model(r[:, 11:])], 1),
                                   atol=1e-10, rtol=1e-10)


def test_gradients_do_not_cross_a_boundary(model):
    ids = torch.randint(0, 512, (1, 30))
    doc_ids = torch.tensor([[0] * 12 + [1] * 18])
    emb = model.embed.weight
    model.zero_grad()
    model(ids, doc_ids=doc_ids)[0, :12].sum().backward()  # the first document's logits only
    used = set(ids[0, 12:].tolist()) - set(ids[0, :12].tolist())
    assert all(emb.grad[t].abs().max() == 0 for t in used)  # no second-document token's embedding gets a gradient
    model.zero_grad()


@pytest.mark.parametrize("bad,match", [
    (torch.zeros(1, 5), "integer tensor shaped like input_ids"),
    (torch.zeros(1, 4, dtype=torch.long), r"shaped like input_ids \(1, 5\)"),
    (torch.zeros(1, 5, dtype=torch.bool), "integer"),
])
def test_bad_doc_ids(model, bad, match):
    with pytest.raises(ValueError, match=match):
        model(torch.zeros(1, 5, dtype=torch.long), doc_ids=bad)
    with pytest.raises(ValueError, match="with a cache"):
        model(torch.zeros(1, 5, dtype=torch.long), model.new_cache(), doc_ids=torch.zeros(1, 5, dtype=torch.long))


def test_packed_prefill_fills_each_documents_cache_as_alone(model):
    """Prompts of 3, 1, 40 and 9 tokens prefilled as one packed row, each into its own fresh cache, then decoded
    on their own: the logits of every step equal a prefill and decode of that prompt alone."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (1, n), generator=g) for n in (3, 1, 40, 9)]
    row = torch.cat(prompts, 1)
    doc_ids = torch.cat([torch.full((1, p.shape[1]), i) for i, p in enumerate(prompts)], 1)
    caches = [model.new_cache() for _ in prompts]
    nxt = torch.randint(0, 512, (len(prompts), 3), generator=g)
    with torch.no_grad():
        h = model.hidden_states(row, doc_ids=doc_ids, doc_caches=caches)
        ends = torch.tensor([p.shape[1] for p in prompts]).cumsum(0) - 1
        first = model.head(h[0, ends])
        for i, (p, c) in enumerate(zip(prompts, caches)):
            ref_cache = model.new_cache()
            torch.testing.assert_close(first[i], model(p, ref_cache)[0, -1], atol=1e-10, rtol=1e-10)
            assert c.seen_tokens == ref_cache.seen_tokens == p.shape[1]
            for t in range(3):
                step = nxt[i:i + 1, t:t + 1]
                torch.testing.assert_close(model(step, c), model(step, ref_cache), atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match="4 fresh caches"):
        model.hidden_states(row, doc_ids=doc_ids, doc_caches=caches[:3])
