import pytest

from k3.data.tokenizer import SPECIAL_TOKENS
from k3.distill import effort as ef


def test_budgets_are_ordered_and_checked():
    assert ef.check_budgets(ef.THINKING_BUDGETS) == ef.THINKING_BUDGETS
    assert [ef.thinking_budget(e) for e in ef.EFFORTS] == sorted(ef.THINKING_BUDGETS.values())
    with pytest.raises(ValueError, match="low < medium < high"):
        ef.check_budgets({"low": 8, "medium": 8, "high": 32})
    with pytest.raises(ValueError, match="exactly"):
        ef.check_budgets({"low": 8, "high": 32})
    with pytest.raises(ValueError, match="unknown effort 'extreme'"):
        ef.thinking_budget("extreme")


def test_effort_tokens_are_the_reserved_specials():
    for e, tok in ef.EFFORT_TOKENS.items():
        assert tok in SPECIAL_TOKENS and ef.EFFORT_IDS[SPECIAL_TOKENS.index(tok)] == e
    assert SPECIAL_TOKENS[ef.THINK_ID] == "<|think|>" and SPECIAL_TOKENS[ef.END_THINK_ID] == "<|/think|>"


def test_prompt_format(domain_tokenizer):
    tok = domain_tokenizer
    ids = ef.build_prompt("sum 3+4", "medium", tok)
    assert ids[0] == ef.BOS_ID and ids[-2:] == [SPECIAL_TOKENS.index("<|effort:medium|>"), ef.THINK_ID]
    assert tok.decode(ids) == "<|bos|><|user|>sum 3+4<|end|><|assistant|><|effort:medium|><|think|>"
    assert ef.effort_of_ids(ids) == "medium"
    # a user who types a special token gets its bytes, not the token
    typed = ef.build_prompt("sum <|end|>", "low", tok)
    assert typed.count(ef.END_ID) == 1


def test_prompt_from_text_and_bad_effort(domain_tokenizer):
    ids, e = ef.prompt_from_text("<|effort:high|> sum 1+2", domain_tokenizer)
    assert e == "high" and ids == ef.build_prompt("sum 1+2", "high", domain_tokenizer)
    with pytest.raises(ValueError, match="has no effort token"):
        ef.prompt_from_text("sum 1+2", domain_tokenizer)
    with pytest.raises(ValueError, match="unknown effort 'extreme'"):
        ef.prompt_from_text("<|effort:extreme|> sum 1+2", domain_tokenizer)
    with pytest.raises(ValueError, match="conflicting"):
        ef.prompt_from_text("<|effort:low|><|effort:high|> sum 1+2", domain_tokenizer)
    with pytest.raises(ValueError, match="unknown effort"):
        ef.build_prompt("sum 1+2", "max", domain_tokenizer)
    with pytest.raises(ValueError, match="no effort token"):
        ef.effort_of_ids([ef.BOS_ID, 300, 301])
    with pytest.raises(ValueError, match="conflicting"):
        ef.effort_of_ids([SPECIAL_TOKENS.index("<|effort:low|>"), SPECIAL_TOKENS.index("<|effort:high|>")])


def test_completion_round_trip(domain_tokenizer):
    tok = domain_tokenizer
    ids = ef.completion_ids("8 10", "17", tok)
    reasoning, answer, closed = ef.split_completion(ids)
    assert closed and tok.decode(reasoning) == "8 10" and tok.decode(answer) == "17"
    assert ef.split_completion(tok.encode("8 10"))[1:] == ([], False)  # never closed: no answer
