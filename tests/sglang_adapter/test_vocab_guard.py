"""The plugin's token-id guard: a request with an id outside the vocabulary is refused by name
in the launcher's tokenizer manager (SGLang 0.5.23 would crash its scheduler on it)."""

import types

import pytest
from qsa_adapters.sglang.vocab_guard import bad_token_id, before_validate_one_request, check_token_ids
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang_harness import ensure_plugin


@pytest.mark.parametrize(
    "ids, bad",
    [
        ([0, 5, 9], None),
        ([], None),
        ([0, 10, 3], (1, 10)),
        ([3, -1], (1, -1)),
        ([1, 2.0], (1, 2.0)),
        ([True, 1], (0, True)),
        ([1, "7"], (1, "7")),
    ],
)
def test_bad_token_id_finds_the_first_entry_outside_the_vocabulary(ids, bad):
    assert bad_token_id(ids, 10) == bad


def test_refusal_names_the_entry_and_the_range():
    with pytest.raises(ValueError, match=r"input_ids\[2\] = 12 is not a token id of this model: expected an integer in \[0, 12\)"):
        check_token_ids([0, 11, 12], 12)
    check_token_ids(None, 12)
    check_token_ids(list(range(12)), 12)


def manager(vocab_size: int):
    return types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=vocab_size))


def test_hook_checks_text_requests_and_leaves_multimodal_ones_to_sglang():
    text = GenerateReqInput(input_ids=[1, 99])
    with pytest.raises(ValueError, match=r"input_ids\[1\] = 99"):
        before_validate_one_request(manager(50), text, text.input_ids)
    image = GenerateReqInput(input_ids=[1, 99], image_data=["unused.png"])
    assert before_validate_one_request(manager(50), image, image.input_ids) is None


def test_plugin_hooks_the_tokenizer_managers_validation():
    """After `load_plugins`, TokenizerManager's own validation raises the guard's refusal first."""
    ensure_plugin()
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    obj = GenerateReqInput(input_ids=[3, 50])
    with pytest.raises(ValueError, match=r"input_ids\[1\] = 50 is not a token id"):
        TokenizerManager._validate_one_request(manager(50), obj, obj.input_ids)
