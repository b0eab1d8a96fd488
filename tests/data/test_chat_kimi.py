"""Kimi K3's chat format: render -> parse round trips, the Jinja template equals the Python renderer, and the
tokenizer reserves the format's tokens without moving an older tokenizer's ids."""
import json

import pytest

from k3.data import chat_kimi as ck
from k3.data.chat import ChatFormatError, chat_format
from k3.data.tokenizer import FORMAT_TOKENS, RESERVED_TOKENS, SPECIAL_TOKENS, Tokenizer, train_tokenizer

GEN = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für eine Stadt",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}}]
CALLS = [{"id": "c1", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Paris \"FR\" & co", "days": 3, "metric": True,
                                                            "at": None, "where": {"lat": 48.9, "tags": ["é", 1]}}}},
         {"id": "c2", "type": "function", "function": {"name": "clock", "arguments": {}}}]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris? I typed <|open|> and <|end|> myself.", "name": "ann"},
    {"role": "assistant", "content": "Let me check.", "reasoning_content": "I need the tool.", "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "12:00"}]},
    {"role": "assistant", "content": "Sunny, 21 C at noon.", "reasoning_content": "Both answered."},
    {"role": "developer", "content": "Answer in French from now on."},
    {"role": "user", "content": "Merci !"},
]


@pytest.fixture(scope="module")
def tok():
    texts = ["def f(x):\n    return x + 1\n" * 50, "Weather in Paris is sunny. Merci ! Wetter für\n" * 50]
    return train_tokenizer(texts, 400, allow_short=True)


def _reply(text: str) -> str:
    """The assistant's last message as the model writes it after the generation prompt (<|end_of_msg|> stops)."""
    return text.split(GEN)[-1].split("<|end_of_msg|>")[0]


def test_rendered_structure():
    text = ck.render_text(CHAT, TOOLS)
    assert text.startswith('<|open|>message role="system" type="tool-declare"<|sep|># Tools\n')
    assert '[{"function":{"description":"Wetter für eine Stadt","name":"get_weather",' in text  # compact, sorted
    assert "`thinking_effort=max`" in text and text.endswith(GEN)
    assert '<|open|>message role="user" name="ann"<|sep|>' in text
    assert ('<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>'
            'Paris "FR" & co<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>3') in text
    assert '<|open|>argument key="where" type="object"<|sep|>{"lat": 48.9, "tags": ["é", 1]}<|close|>' in text
    assert '<|open|>message role="tool" tool="clock" index="2"<|sep|>12:00<|close|>message' in text
    assert '<|open|>message role="system"<|sep|>Answer in French' in text  # developer is rendered as system
    off = ck.render_text(CHAT[:2], thinking=False)
    assert "thinking-effort" not in off and off.endswith('<|open|>response<|sep|>')
    assert "`thinking_effort=low`" in ck.render_text(CHAT[:2], reasoning_effort="low")


def test_tool_results_follow_the_calls_order():
    swapped = CHAT[:3] + [CHAT[4], CHAT[3]]
    assert ck.render_text(swapped) == ck.render_text(CHAT[:5])
    # results that do not name a call keep their order and take their name from the message or the call
    loose = CHAT[:3] + [{"role": "tool", "content": "x"}, {"role": "tool", "name": "other", "content": "y"}]
    text = ck.render_text(loose)
    assert 'tool="get_weather" index="1"<|sep|>x' in text and 'tool="other" index="2"<|sep|>y' in text
    with pytest.raises(ChatFormatError, match="tool name"):
        ck.render_text([{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}])


def test_render_parse_round_trip():
    text = ck.render_text(CHAT[:3], TOOLS, add_generation_prompt=False)
    content, reasoning, calls = ck.parse_reply(_reply(text))
    assert (content, reasoning) == ("Let me check.", "I need the tool.")
    assert [c.name for c in calls] == ["get_weather", "clock"]
    assert [json.loads(c.arguments) for c in calls] == [c["function"]["arguments"] for c in CALLS]
    # the parsed message renders to the same text again (ids aside, which the format does not carry)
    back = {"role": "assistant", "content": content, "reasoning_content": reasoning,
            "tool_calls": [c.to_openai() for c in calls]}
    assert ck.render_text(CHAT[:2] + [back], TOOLS, add_generation_prompt=False) == text
    # every assistant turn of a multi-turn conversation comes back
    for k in (2, 5):
        assistant = CHAT[k]
        got = ck.parse_reply(_reply(ck.render_text(CHAT[:k + 1], TOOLS, add_generation_prompt=False)))
        assert got[:2] == (assistant["content"], assistant["reasoning_content"])


@pytest.mark.parametrize("width", [1, 3, 1000])
def test_streamed_parse_equals_whole(width):
    reply = _reply(ck.render_text(CHAT[:3], TOOLS, add_generation_prompt=False))
    p, out = ck.XtmlOutputParser(), []
    for i in range(0, len(reply), width):
        out += p.feed(reply[i:i + width])
    out += p.feed("", final=True)
    content = "".join(v for k, v in out if k == "content")
    reasoning = "".join(v for k, v in out if k == "reasoning")
    assert (content, reasoning) == ck.parse_reply(reply)[:2] == ("Let me check.", "I need the tool.")
    assert [v.name for k, v in out if k == "tool_call"] == ["get_weather", "clock"]


def test_parse_with_markers_and_odd_replies():
    reply = "<|close|>think<|sep|><|open|>response<|sep|>see <|open|> here<|close|>response<|sep|>"
    literal = reply.index("see ") + 4  # this <|open|> is text the model spelled, not a token
    spans = sorted((i, i + len(t)) for t in FORMAT_TOKENS for i in range(len(reply))
                   if reply.startswith(t, i) and i != literal)
    assert len(spans) == 6
    assert ck.parse_reply(reply, spans)[:2] == ("see <|open|> here", "")
    # a response opened without closing the thought ends it; text outside any section is content
    assert ck.parse_reply("hmm<|open|>response<|sep|>yes")[:2] == ("yes", "hmm")
    # a call never closed is given back as content, nothing lost
    cut = '<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>argument key="a"'
    content, _, calls = ck.parse_reply(cut)
    assert calls == [] and content == '<|open|>call tool="f" index="1"<|sep|><|open|>argument key="a"'
    # arguments given as a json element come back as that text
    js = ('<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>json '
          'type="object"<|sep|>{"a": 1}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')
    assert [(c.name, c.arguments) for c in ck.parse_reply(js)[2]] == [("f", '{"a": 1}')]


def test_jinja_template_renders_the_python_string():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = _compile_jinja_template(ck.CHAT_TEMPLATE)
    for kw in ({}, {"reasoning_effort": "high"}, {"thinking": False}):
        for gen in (True, False):
            for msgs in (CHAT, CHAT[:3], CHAT[:1] + [{"role": "tool", "name": "f", "content": "x"}]):
                want = ck.render_text(msgs, TOOLS, kw.get("reasoning_effort"), gen, kw.get("thinking", True))
                assert template.render(messages=msgs, tools=TOOLS, add_generation_prompt=gen, **kw) == want


def test_exported_tokenizer_template_gives_the_same_ids(tok, tmp_path):
    from transformers import AutoTokenizer

    from k3.io.hf import to_hf_tokenizer

    to_hf_tokenizer(tok).save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    msgs = [m for m in CHAT if "<|" not in str(m.get("content"))]  # text spelling a token is the known difference
    text = hf.apply_chat_template(msgs, tools=TOOLS, chat_template="kimi-k3", tokenize=False,
                                  add_generation_prompt=True)
    assert text == ck.render_text(msgs, TOOLS)
    assert hf(text, add_special_tokens=False)["input_ids"] == ck.render(msgs, tok, TOOLS)
    assert "<|user|>" in hf.apply_chat_template(msgs, tokenize=False)  # k3's own format stays the default


def test_tokenizer_reserves_the_format_tokens(tok):
    assert tok.n_special == len(RESERVED_TOKENS) == len(SPECIAL_TOKENS) + 4
    assert [tok.token_to_id(t) for t in RESERVED_TOKENS] == list(range(len(RESERVED_TOKENS)))
    ids = ck.render([{"role": "user", "content": "I typed <|open|>"}], tok)
    # the thinking-effort and user messages, the prompt's message and think tags; not the typed text
    assert ids.count(tok.special_id("<|open|>")) == 4
    chat_format("kimi-k3").check_tokenizer(tok)


def test_older_tokenizer_keeps_its_ids_and_refuses_the_format(tok):
    """A tokenizer trained before the format tokens were reserved has BPE tokens at 17..20: it loads with the same
    ids, serves k3's own format, and the Kimi K3 format is refused with what to do."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(["hello world " * 30], trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    old = Tokenizer(hf)
    before = [hf.id_to_token(i) for i in range(old.vocab_size)]
    assert old.n_special == len(SPECIAL_TOKENS) and hf.token_to_id(FORMAT_TOKENS[0]) is None
    assert [old.hf.id_to_token(i) for i in range(old.vocab_size)] == before
    with pytest.raises(ValueError, match="retrain it with `k3 tokenize`"):
        chat_format("kimi-k3").check_tokenizer(old)
    assert old.special_id("eos") == 1
    # the smallest vocabularies have no room for them and keep k3's tokens only
    assert train_tokenizer(["ab"], len(SPECIAL_TOKENS) + 256).n_special == len(SPECIAL_TOKENS)
