"""Tokenizer: round trips, UTF-8-safe streaming detokenization, sandboxed chat templates,
and the tokenizer_config.json variants found in the wild."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from engine.chat_template import ChatTemplate
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import BatonError, CheckpointError
from engine.tokenizer import Tokenizer

TEXTS = [
    "hello world",
    "def f(x):\n    return x ** 2  # square\n",
    "日本語のテキスト、中文字符",
    "emoji 🙂👍🏽 and flags 🇫🇷 and zwj 👩‍💻",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937",
    "  leading and trailing spaces  \t\n",
    "",
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def byte_token_ids(tok: Tokenizer) -> list[int]:
    """The id of each single-byte token, indexed by byte value (GPT-2's byte ↔ char map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += list(range(ord("®"), ord("ÿ") + 1))
    char_of: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for byte in range(256):
        if byte not in char_of:
            char_of[byte] = chr(256 + extra)
            extra += 1
    ids = [tok._backend.token_to_id(char_of[b]) for b in range(256)]
    assert all(i is not None for i in ids)
    return ids


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


# --- encode / decode --------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 1
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_tiny_tokenizer_facts(tok: Tokenizer) -> None:
    assert tok.vocab_size == 16_384
    assert tok.eos_token_ids == (2,)
    assert tok.model_max_length == 8_192
    assert [tok.is_special(i) for i in range(5)] == [True, True, True, True, False]


# --- incremental detokenization ---------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_streams_encoded_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(tok.new_detokenizer(tok.encode("prompt: ")), ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_single_byte_tokens_never_split_a_character(tok: Tokenizer) -> None:
    byte_ids = byte_token_ids(tok)
    text = "a€b🙂c世é"
    ids = [byte_ids[b] for b in text.encode("utf-8")]
    deltas = stream(tok.new_detokenizer([]), ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    # each character appears exactly when its last byte arrives
    assert [d for d in deltas if d] == list(text)


def test_long_invalid_byte_run_stays_exact_and_bounded(tok: Tokenizer) -> None:
    byte_ids = byte_token_ids(tok)
    raw = [0x80] * 40 + [0xE2] + [0xFF] * 20 + list("€".encode()) + [0xF0, 0x9F] + list(b"ok")
    ids = [byte_ids[b] for b in raw]
    detok = tok.new_detokenizer([])
    deltas = []
    for token_id in ids:
        deltas.append(detok.push(token_id))
        assert len(detok._ids) <= 16  # the window is cut, not re-decoded from the start
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids)


def test_special_tokens_are_skipped_while_streaming(tok: Tokenizer) -> None:
    ids = tok.encode("hi", add_special_tokens=False) + [2, 3] + tok.encode(" there", False)
    assert "".join(stream(tok.new_detokenizer([1]), ids)) == "hi there"


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_detokenizer_matches_full_decode(tok: Tokenizer, data: st.DataObject) -> None:
    byte_ids = byte_token_ids(tok)
    token = st.one_of(
        st.integers(0, tok.vocab_size - 1),
        st.sampled_from(byte_ids[0x80:]),  # continuation and lead bytes: the hard part
        st.sampled_from(byte_ids),
    )
    ids = data.draw(st.lists(token, max_size=60))
    prompt = data.draw(st.sampled_from([[], [1], tok.encode("x = 1\n")]))
    deltas = stream(tok.new_detokenizer(prompt), ids)
    full = tok.decode(ids)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


# --- a sentencepiece-style tokenizer (Llama 2): "▁" spaces and <0xNN> byte fallback -----------


def write_sentencepiece_style(directory: Path, tokenizer_config: dict[str, object]) -> Path:
    specials = ["<unk>", "<s>", "</s>"]
    pieces = [*specials, *(f"<0x{b:02X}>" for b in range(256)), "▁"]
    pieces += [chr(c) for c in range(ord("a"), ord("z") + 1)]
    merges: list[tuple[str, str]] = []
    for word in ("▁hello", "▁world", "▁the", "lo"):
        current = word[0]
        for ch in word[1:]:
            if current + ch not in pieces:
                merges.append((current, ch))
                pieces.append(current + ch)
            current += ch
    vocab = {piece: i for i, piece in enumerate(pieces)}
    backend = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens(specials)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    config = {
        "bos_token": {"content": "<s>", "lstrip": False},
        "eos_token": "</s>",
        "add_bos_token": True,
    }
    return Tokenizer.from_dir(write_sentencepiece_style(tmp_path_factory.mktemp("sp"), config))


@pytest.mark.parametrize("text", ["hello world", "the 世界 🙂 lo", "x\u0301 hello"])
def test_sentencepiece_style_round_trip_and_stream(sp_tok: Tokenizer, text: str) -> None:
    ids = sp_tok.encode(text)
    assert ids[0] == sp_tok.bos_token_id == 1  # add_bos_token prepends: no post-processor
    assert sp_tok.decode(ids) == text
    out = ids[1:]
    assert "".join(stream(sp_tok.new_detokenizer([]), out)) == sp_tok.decode(out)
    # After a prompt, the leading "▁" of the first output token is a real space.
    prompt = sp_tok.encode("the")
    deltas = stream(sp_tok.new_detokenizer(prompt), out)
    assert "".join(deltas) == sp_tok.decode(prompt + out)[len(sp_tok.decode(prompt)) :]
    assert "".join(deltas).startswith(" ")
    assert not any("\ufffd" in d for d in deltas)


SP_BYTE0 = 3  # <0x00>'s id: the byte tokens follow the three specials


def _sp_piece(sp_tok: Tokenizer) -> st.SearchStrategy[list[int]]:
    """One character as its <0xNN> byte tokens (UTF-8, mostly past ASCII: lead and continuation
    bytes, the hard part), or one ordinary piece ("▁", a letter, a merge)."""
    char = st.characters(min_codepoint=0x80, max_codepoint=0x10FFFF, exclude_categories=("Cs",),
                         exclude_characters="\ufffd")  # what an invalid byte decodes to
    as_bytes = char.map(lambda c: [SP_BYTE0 + b for b in c.encode()])
    piece = st.integers(SP_BYTE0 + 256, sp_tok.vocab_size - 1).map(lambda i: [i])
    return st.one_of(as_bytes, as_bytes, piece)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_sentencepiece_style_detokenizer_matches_full_decode(
    sp_tok: Tokenizer, data: st.DataObject
) -> None:
    # Whole characters only: ByteFallback decodes a run of <0xNN> tokens as a whole, so one
    # invalid byte would turn the run into U+FFFDs, even a character streamed earlier; every
    # example here is exact, none skipped.
    ids = [i for part in data.draw(st.lists(_sp_piece(sp_tok), max_size=20)) for i in part]
    deltas = stream(sp_tok.new_detokenizer([]), ids)
    full = sp_tok.decode(ids)
    assert "\ufffd" not in full
    assert "".join(deltas) == full
    assert not any("\ufffd" in d for d in deltas)


def test_the_sentencepiece_property_sees_multibyte_characters(sp_tok: Tokenizer) -> None:
    seen: list[int] = []

    @settings(max_examples=50, deadline=None, database=None)
    @given(part=_sp_piece(sp_tok))
    def draw(part: list[int]) -> None:
        seen.extend(part)

    draw()
    assert sum(SP_BYTE0 + 0x80 <= i < SP_BYTE0 + 256 for i in seen) >= 20  # bytes >= 0x80, often


# --- chat templates ---------------------------------------------------------------------------


def test_default_chat_template_renders(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    expected = (
        "<s><|system|>\nBe terse.\n<|user|>\nHi\n<|assistant|>\nHello.\n<|user|>\nBye\n"
        "<|assistant|>\n"
    )
    assert tok.apply_chat_template(messages) == expected
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected[:-14]
    with pytest.raises(BatonError, match="unknown message role: wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])


def test_hf_template_helpers() -> None:
    source = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}"
        "{% endif %}{% set ns.n = ns.n + 1 %}{% generation %}{{ m | tojson }}{% endgeneration %}\n"
        "{% endfor %}{{ ns.n }} {{ tools | tojson(indent=None, sort_keys=True) }}"
    )
    messages = [{"role": "user", "content": "é<b>"}, {"role": "user", "content": "2"}, {"x": 3}]
    rendered = ChatTemplate(source).render({"messages": messages, "tools": [{"b": 1, "a": "ü"}]})
    assert rendered == (
        '{"role": "user", "content": "é<b>"}{"role": "user", "content": "2"}2 [{"a": "ü", "b": 1}]'
    )


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ namespace.__init__.__globals__['os'] }}",
        "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
        "{{ messages.append(1) }}",
        "{{ range(10**9) | list | length }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    ],
)
def test_hostile_templates_raise_baton_error(source: str) -> None:
    with pytest.raises(BatonError):
        ChatTemplate(source).render({"messages": []})


def test_template_errors_are_baton_errors() -> None:
    with pytest.raises(BatonError, match="invalid"):
        ChatTemplate("{% for %}")
    with pytest.raises(BatonError, match="no system messages"):
        ChatTemplate("{{ raise_exception('no system messages') }}").render({})
    with pytest.raises(BatonError, match="ZeroDivisionError"):
        ChatTemplate("{{ 1 // 0 }}").render({})


# --- tokenizer_config.json variants -----------------------------------------------------------


def copy_tokenizer(src: Path, dst: Path, config: dict[str, object] | None) -> Path:
    dst.mkdir()
    shutil.copyfile(src / "tokenizer.json", dst / "tokenizer.json")
    if config is not None:
        (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_config_variants(tiny_model_dir: Path, tmp_path: Path) -> None:
    named = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D{{ bos_token }}"},
    ]
    config = {
        "bos_token": {"content": "<s>"},
        "eos_token": {"content": "</s>"},
        "chat_template": named,
    }
    tok = Tokenizer.from_dir(copy_tokenizer(tiny_model_dir, tmp_path / "a", config))
    assert tok.apply_chat_template([]) == "D<s>"
    assert tok.eos_token_ids == (2,)

    config = {"bos_token": "<s>", "add_bos_token": False, "model_max_length": int(1e30)}
    tok = Tokenizer.from_dir(copy_tokenizer(tiny_model_dir, tmp_path / "b", config))
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    assert tok.model_max_length is None

    # No tokenizer_config.json: ids come from config/generation_config, template is the default.
    bare = copy_tokenizer(tiny_model_dir, tmp_path / "c", None)
    (bare / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 3]}))
    (bare / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 5, 99999]}))
    tok = Tokenizer.from_dir(bare)
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (3, 5, 2)
    assert (
        tok.apply_chat_template([{"role": "user", "content": "q"}])
        == "<s><|user|>\nq\n<|assistant|>\n"
    )

    (bare / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert Tokenizer.from_dir(bare).apply_chat_template([]) == "J0"


@pytest.mark.parametrize(
    ("config_text", "message"),
    [
        ("{not json", "not valid JSON"),
        (
            '{"chat_template": [{"name": "tool_use", "template": "T"}]}',
            "no template named 'default'",
        ),
        ('{"bos_token": 5}', "bos_token"),
    ],
)
def test_bad_configs_raise_checkpoint_error(
    tiny_model_dir: Path, tmp_path: Path, config_text: str, message: str
) -> None:
    directory = copy_tokenizer(tiny_model_dir, tmp_path / "t", None)
    (directory / "tokenizer_config.json").write_text(config_text)
    with pytest.raises(CheckpointError, match=message):
        Tokenizer.from_dir(directory)


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        Tokenizer.from_dir(tmp_path)
