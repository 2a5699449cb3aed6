"""Every architecture the config reader accepts has a decoder class, and no other."""

import pytest

from pdserve.common.model_config import SUPPORTED_ARCHITECTURES
from pdserve.engine.model.registry import MODEL_CLASSES, model_class


def test_each_supported_architecture_has_a_class() -> None:
    assert sorted(MODEL_CLASSES) == sorted(SUPPORTED_ARCHITECTURES)


def test_an_unknown_architecture_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*Llama"):
        model_class("GPT2LMHeadModel")
