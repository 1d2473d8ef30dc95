"""Test-environment shim: lets vLLM's Qwen4-Exp import chain load without torchvision.

vLLM's `qwen3_vl` (imported by its Qwen4-Exp model) imports `smart_resize` from transformers'
`image_processing_qwen2_vl`, a module that imports torchvision at its top. The PyPI
torchvision wheels are CUDA builds that fail to load beside torch 2.13.0+cpu, and the CPU
builds are not on PyPI. When torchvision is absent, this maps that one module name onto
transformers' PIL twin (`image_processing_pil_qwen2_vl`, same `smart_resize`); nothing else
changes. `scripts/env_vllm.sh` installs it into the vLLM venv with a `.pth` line, so every
Python process of that venv (vLLM's spawned engine processes too) has it.

Multimodal serving of `Qwen4ExpForConditionalGeneration` also loads the checkpoint's processor,
`Qwen3VLProcessor`, whose video processor class transformers hides without torchvision (its
`AutoVideoProcessor` and `VideoProcessorMixin` resolve to placeholders that raise
"requires the Torchvision library"). The class itself (`Qwen3VLVideoProcessor`) imports and
builds without torchvision; only processing a video needs it. So, once
`transformers.processing_utils` loads, the shim lets that one class through: the processor's
base-class check sees the real `VideoProcessorMixin`, and `AutoVideoProcessor.from_pretrained`
builds a checkpoint's `Qwen3VLVideoProcessor` directly (any other video processor keeps the
original error). Images are served; videos still need torchvision (serve with
`--limit-mm-per-prompt '{"video": 0}'`, which also keeps vLLM's start-up profiling off videos).
A machine with a torchvision that loads (e.g. the CPU build from PyTorch's own index) does
not need it: the shim then does nothing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

TARGET = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
STAND_IN = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return importlib.import_module(STAND_IN)

    def exec_module(self, module):
        sys.modules[TARGET] = module


PROCESSING = "transformers.processing_utils"
VIDEO_AUTO = "transformers.models.auto.video_processing_auto"
VIDEO_CLASS = ("transformers.models.qwen3_vl.video_processing_qwen3_vl", "Qwen3VLVideoProcessor")


def _video_processor_type(path, kwargs: dict) -> str | None:
    """The `video_processor_type` a checkpoint's processor config names, if any (a local
    folder or a Hub model id, resolved as transformers resolves it)."""
    import json

    from transformers.utils import cached_file

    where = {k: kwargs[k] for k in ("cache_dir", "token", "revision", "local_files_only", "subfolder") if k in kwargs}
    for name, key in (("video_preprocessor_config.json", None), ("processor_config.json", "video_processor")):
        file = cached_file(path, name, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **where)
        if file is not None:
            with open(file) as f:
                config = json.load(f)
            config = config.get(key, {}) if key else config
            if "video_processor_type" in config:
                return config["video_processor_type"]
    return None


def _video_class():
    return getattr(importlib.import_module(VIDEO_CLASS[0]), VIDEO_CLASS[1])


class _AutoVideoProcessor:
    """`AutoVideoProcessor.from_pretrained` for a checkpoint whose video processor is
    `Qwen3VLVideoProcessor` (built directly); others get transformers' own (and its error)."""

    @staticmethod
    def from_pretrained(pretrained_model_name_or_path, *args, **kwargs):
        if _video_processor_type(pretrained_model_name_or_path, kwargs) != VIDEO_CLASS[1]:
            original = importlib.import_module(VIDEO_AUTO).AutoVideoProcessor
            return original.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        kwargs.pop("_from_auto", None)
        kwargs.pop("backend", None)
        return _video_class().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)


def _expose_video_processor(processing) -> None:
    """(Right after `transformers.processing_utils` executes) let `Qwen3VLVideoProcessor`
    through: the processor's base-class check and its sub-processor loading resolve the video
    processor lazily, at call time (importing the video modules here would be circular)."""
    mapping = type(processing.MODALITY_TO_AUTOPROCESSOR_MAPPING)
    getitem = mapping.__getitem__

    def video_aware_getitem(self, key):
        return _AutoVideoProcessor if key == "video_processor" else getitem(self, key)

    mapping.__getitem__ = video_aware_getitem
    mixin = processing.ProcessorMixin
    lookup = mixin.get_possibly_dynamic_module

    def get_possibly_dynamic_module(module_name):
        if module_name == "VideoProcessorMixin":
            return importlib.import_module("transformers.video_processing_utils").VideoProcessorMixin
        return lookup(module_name)

    mixin.get_possibly_dynamic_module = staticmethod(get_possibly_dynamic_module)


class _AfterProcessing(importlib.abc.MetaPathFinder):
    """Runs `_expose_video_processor` right after `transformers.processing_utils` executes."""

    def find_spec(self, name, path=None, target=None):
        if name != PROCESSING:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_expose(module):
            exec_module(module)
            _expose_video_processor(module)

        spec.loader.exec_module = exec_then_expose
        return spec


def install() -> None:
    if importlib.util.find_spec("torchvision") is None and not any(isinstance(f, _StandIn) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandIn())
        sys.meta_path.insert(0, _AfterProcessing())


install()
