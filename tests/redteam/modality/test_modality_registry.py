"""The modality registry and the one table of data sources."""

import dataclasses

import pytest

from guardfl.errors import ConfigError
from guardfl.redteam import modality
from guardfl.redteam.config import load_config


def test_every_source_has_a_registered_modality():
    assert set(modality.MODALITIES) == {"image", "text"}
    for name, source in modality.SOURCES.items():
        assert modality.for_source(name).name == source.modality
    assert modality.for_source("cifar10") is modality.get("image")
    assert modality.for_source("wikitext") is modality.get("text")


def test_source_lists_keep_their_order():
    assert modality.DATA_SOURCES == ("lfw-faces", "lfw-nonfaces", "cifar10", "cifar100", "mnist", "fashion-mnist",
                                     "imagefolder", "npz", "text", "labelled-text", "wikitext", "cola")
    assert modality.UTILITY_SOURCES == ("lfw-detection", "cifar10", "cifar100", "mnist", "fashion-mnist", "imagefolder",
                                        "npz", "text", "labelled-text", "wikitext", "cola")


def test_unknown_source_is_a_one_line_error():
    with pytest.raises(ConfigError) as err:
        modality.for_source("imagenet")
    assert "\n" not in str(err.value) and "'imagenet'" in str(err.value) and "allowed: lfw-detection" in str(err.value)
    with pytest.raises(ConfigError, match="unknown modality 'audio'"):
        modality.get("audio")


def test_registering_a_name_twice_is_refused():
    again = dataclasses.replace(modality.get("text"))
    with pytest.raises(ValueError, match="'text' is already registered"):
        modality.register(again)
    assert modality.get("text") is not again


def test_modality_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        modality.get("image").unit = "picture"


def test_of_a_config_an_object_and_a_mapping():
    cfg = load_config({"data": {"source": "text"}, "model": {"name": "transformer3"}})
    assert modality.of(cfg) is modality.get("text")
    assert modality.of(cfg.model_dump(mode="json")) is modality.get("text")
    assert modality.of({"data": {}}) is modality.get(modality.DEFAULT)
    assert modality.of(load_config({})).units == "images"


def test_units_thresholds_and_plot_metrics():
    image, text = modality.get("image"), modality.get("text")
    assert (image.unit, image.units, text.unit, text.units) == ("image", "images", "sequence", "sequences")
    assert image.thresholds["lpips"] == ("min_lpips", "min") and text.thresholds["rouge1"] == ("max_rouge1", "max")
    assert image.plot_metrics == [("ssim", "max_ssim"), ("psnr", "max_psnr"), ("lpips", "min_lpips")]
    assert text.plot_metrics == [("rouge1", "max_rouge1"), ("rouge2", "max_rouge2"), ("token_acc", "max_token_acc")]


def test_models_belong_to_one_modality():
    assert modality.for_model("lenet") is modality.get("image")
    assert modality.for_model("transformer3") is modality.get("text")
    assert modality.for_model("pkg.mod:factory") is modality.get(modality.DEFAULT)
    assert not modality.get("image").models & modality.get("text").models


def test_text_source_task_decides_the_loader_task():
    assert modality.SOURCES["wikitext"].task == "causal-lm" and modality.SOURCES["cola"].task == "classification"
    assert all(s.task is None for s in modality.SOURCES.values() if s.modality == "image")
