"""Chat templates read from HF tokenizer files render exactly like transformers' apply_chat_template."""

# ruff: noqa: F811  (fixtures imported from tests.conftest_tokenizers are re-bound as arguments)

from __future__ import annotations

from poly.text.chat import ChatTemplate
from tests.conftest_tokenizers import (  # noqa: F401  (fixtures)
    hf_smol_tokenizer,
    smol_hf_pair,
    smol_tokenizer_config,
    smol_tokenizer_dir,
)
from tests.test_chat_template import CONVERSATIONS, hf_tok, smol_template  # noqa: F401  (fixtures)


def test_from_dir_reads_chat_template_jinja(hf_smol_tokenizer, tmp_path):
    # transformers 5 saves the template as chat_template.jinja by default.
    hf_smol_tokenizer.save_pretrained(str(tmp_path))
    assert (tmp_path / "chat_template.jinja").is_file()
    tpl = ChatTemplate.from_dir(tmp_path)
    for msgs in CONVERSATIONS.values():
        expected = hf_smol_tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True
        )
        assert tpl.render(msgs) == expected


def test_other_special_tokens_reach_the_template(hf_tok, smol_tokenizer_config):
    src = "{{ bos_token }}|{{ unk_token }}|{{ pad_token }}|{{ eos_token }}{{ messages[0].content }}"
    hf_tok.chat_template = src
    cfg = {**smol_tokenizer_config, "chat_template": src}
    msgs = CONVERSATIONS["user_only"]
    expected = hf_tok.apply_chat_template(msgs, tokenize=False)
    assert ChatTemplate.from_tokenizer_config(cfg).render(msgs) == expected


def test_special_tokens_round_trip(smol_template):
    again = ChatTemplate(smol_template.source, special_tokens=smol_template.special_tokens)
    assert again.special_tokens == smol_template.special_tokens
    msgs = CONVERSATIONS["multi_turn"]
    assert again.render(msgs) == smol_template.render(msgs)
