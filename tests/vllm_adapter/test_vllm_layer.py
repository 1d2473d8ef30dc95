"""The vLLM QSA layer over caches that vLLM's own allocator lays out, against the core.

Two `QSAAttentionLayer`s register their specs; vLLM's grouping, layout resolution,
allocation and binding (`get_kv_cache_groups`, `allocate_kv_cache`, ...) give the packed
block-outermost views; the layers then run steps whose metadata comes from the real
builder. Outputs and cache contents must equal a core `Runner` with the same weights.
"""

import tempfile

import pytest

import torch  # noqa: E402
from torch import nn  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.distributed.parallel_state import model_parallel_is_initialized  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.model_loader.utils import process_weights_after_loading  # noqa: E402
from vllm.model_executor.model_loader.weight_utils import default_weight_loader  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache, bind_kv_cache_to_layers  # noqa: E402
from vllm_batches import common_metadata  # noqa: E402

from qsa_adapters.vllm.attention import QSAAttentionLayer  # noqa: E402
from qsa_adapters.vllm.backend import QSACoreBackend, QSAStepMetadataBuilder  # noqa: E402
from qwen4_checkpoint import tiny_config, write_checkpoint  # noqa: E402
from qsa_core import QSAAttention, QSAConfig  # noqa: E402
from qsa_core.standalone import Runner  # noqa: E402

PAGE = 16
NUM_PAGES = 48
RING_BLOCKS = NUM_PAGES + 1  # ring blocks after the main pages: one pool serves both groups


class Stack:
    """Two vLLM QSA layers bound to vLLM-allocated caches, and their core twins in a Runner."""

    def __init__(self, hf=None) -> None:
        load_general_plugins()
        self.hf = tiny_config() if hf is None else hf
        folder = tempfile.mkdtemp()
        weights = write_checkpoint(folder, self.hf, seed=3).state_dict()
        model_config = ModelConfig(model=folder, skip_tokenizer_init=True, dtype="float32", max_model_len=256)
        self.vllm_config = vc = VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=PAGE, enable_prefix_caching=False))
        with set_current_vllm_config(vc):
            if not model_parallel_is_initialized():
                init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, backend="gloo")
                initialize_model_parallel(1, 1)
            self.layers = nn.ModuleList(
                QSAAttentionLayer(vllm_config=vc, config=self.hf, layer_id=i, prefix=f"model.layers.{i}.self_attn")
                for i in range(2)
            )
        core = []
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}.self_attn."
            mine = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
            for name, param in layer.named_parameters():
                getattr(param, "weight_loader", default_weight_loader)(param, mine[name])
            twin = QSAAttention(QSAConfig.from_hf(self.hf))
            twin.load_state_dict(mine, strict=True)
            core.append(twin)
        process_weights_after_loading(self.layers, model_config, torch.device("cpu"))
        self.runner = Runner(core, page_size=PAGE, num_pages=NUM_PAGES, max_requests=4, shuffle_pages=True)
        self.bind()

    def bind(self, kv_bytes: int = 8 << 20) -> int:
        """Allocate and bind caches of kv_bytes through vLLM (as its runner does); their blocks."""
        vc = self.vllm_config
        context = vc.compilation_config.static_forward_context
        specs = {name: layer.get_kv_cache_spec(vc) for name, layer in context.items()}
        names = [[layout.name for layout in QSACoreBackend.supported_kv_cache_layouts()]]
        layout = resolve_kv_cache_layout(vc, names, specs.values())
        groups = get_kv_cache_groups(vc, specs)
        kv_config = get_kv_cache_config_from_groups(vc, groups, kv_bytes)
        assert kv_config.num_blocks > RING_BLOCKS + 4
        bind_kv_cache_to_layers(allocate_kv_cache(kv_config, torch.device("cpu"), layout), context)
        self.groups = [
            (group.layer_names, QSAStepMetadataBuilder(group.kv_cache_spec, group.layer_names, vc, torch.device("cpu")))
            for group in groups
        ]
        self.ring_names = {layer.indexer.raw_key_cache.prefix for layer in self.layers}
        return kv_config.num_blocks

    def attn_metadata(self, common, ring_table):
        out = {}
        for names, builder in self.groups:
            is_ring = any(name in self.ring_names for name in names)
            record = builder.build(0, common.replace(block_table_tensor=ring_table) if is_ring else common)
            out.update({name: record for name in names})
        return out

    def step(self, chunks, block_offset: int = 1, rope_positions=None):
        """Run one step on both sides: ({id: runner output}, {id: vLLM layer output}); vLLM's
        block = the runner's page + block_offset. rope_positions: {id: int64 [3, n]} (MRoPE),
        handed to vLLM's layers as its model runner hands them, [3, T] beside 1-D metadata."""
        ref = self.runner.step(chunks, rope_positions=rope_positions)
        meta = self.runner.last_metadata
        common, ring = common_metadata(meta, block_offset=block_offset, ring_offset=RING_BLOCKS)
        positions = common.positions if rope_positions is None else meta.rope_positions
        x = torch.cat([chunks[k] for k in ref])
        with set_forward_context(self.attn_metadata(common, ring), self.vllm_config), torch.no_grad():
            for layer in self.layers:
                x = layer(positions, x)
        mine, start = {}, 0
        for k, out in ref.items():
            mine[k] = x[start : start + out.shape[0]]
            start += out.shape[0]
        return ref, mine


@pytest.fixture(scope="module")
def stack():
    return Stack()


def test_packed_views_and_geometry(stack):
    layer = stack.layers[0]
    cache, geometry = layer.indexer.layer_cache(layer.kv_cache)
    # one block holds 2 layers x (main page + its compressed rows): the core's paged views keep
    # vLLM's block strides, core page = vLLM block
    assert (geometry.page_size, geometry.ring_capacity) == (PAGE, 4)
    kv, ring = layer.kv_cache, layer.indexer.raw_key_cache.kv_cache
    kv_bytes = PAGE * 2 * 2 * 64 * 4  # [Hkv 2, page, 2D 128] fp32
    assert cache.compressed.shape[1:] == (PAGE // 4, 64)
    assert cache.compressed.stride(0) * 4 == kv.stride(0) * 4 > kv_bytes  # the same block stride (bytes)
    assert cache.compressed.data_ptr() == kv.data_ptr() + kv_bytes  # right behind the block's K/V
    assert cache.ring.stride(0) == ring.stride(0) and cache.ring.data_ptr() == ring.data_ptr()
    assert cache.k.data_ptr() == kv.data_ptr()


def test_layers_match_the_core_runner_over_vllm_caches(stack):
    g = torch.Generator().manual_seed(5)
    hid = stack.hf.hidden_size
    schedule = [{"a": 37, "b": 11}, {"b": 1, "a": 30, "c": 20}, {"b": 1, "c": 1, "a": 13}]
    schedule += [{"a": 1, "b": 1, "c": 1}] * 6
    for step in schedule:
        chunks = {k: torch.randn(n, hid, generator=g) for k, n in step.items()}
        ref, mine = stack.step(chunks)
        for k in ref:
            torch.testing.assert_close(mine[k], ref[k], rtol=1e-4, atol=1e-5, msg=f"request {k}, step {step}")
    # what the core Runner wrote into its caches, vLLM's views hold at the mapped pages
    meta = stack.runner.last_metadata
    common, ring = common_metadata(meta, block_offset=1, ring_offset=RING_BLOCKS)
    for layer, core_cache in zip(stack.layers, stack.runner.caches):
        cache, geometry = layer.indexer.layer_cache(layer.kv_cache)
        for req in range(meta.num_reqs):
            n = int(meta.seq_lens[req])
            pages = meta.block_table[req, : -(-n // PAGE)].long()
            vpages = common.block_table_tensor[req, : len(pages)].long()
            torch.testing.assert_close(cache.k[vpages].flatten(0, 1)[:n], core_cache.k[pages].flatten(0, 1)[:n])
            torch.testing.assert_close(cache.v[vpages].flatten(0, 1)[:n], core_cache.v[pages].flatten(0, 1)[:n])
            torch.testing.assert_close(cache.compressed[vpages].flatten(0, 1)[: n // 4],
                                       core_cache.compressed[pages].flatten(0, 1)[: n // 4], rtol=1e-4, atol=1e-5)


def test_mrope_layers_match_the_core_runner_with_ring_positions_in_vllms_ring_blocks():
    """MRoPE (interleaved (11, 11, 10)): the ring positions live in the padding of vLLM's ring
    blocks (right behind each block's raw keys), and with 3-axis positions that differ per axis
    the layers equal the core Runner. Chunks end inside groups, so group keys are rotated at a
    first token's 3-axis position stored by an earlier step: the positions vLLM's ring blocks
    hold equal the Runner's."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    stack = Stack(tiny_config(head_dim=128, rope_parameters=rope))
    layer = stack.layers[0]
    cache, geometry = layer.indexer.layer_cache(layer.kv_cache)
    ring = layer.indexer.raw_key_cache.kv_cache  # [blocks, 1, C, Di] fp32, padded blocks
    C, Di = geometry.ring_capacity, stack.hf.indexer_head_dim
    assert cache.ring_positions.shape == (ring.shape[0], C, 3) and cache.ring_positions.dtype == torch.int64
    assert cache.ring_positions.data_ptr() == ring.data_ptr() + C * Di * 4  # behind the block's raw keys
    assert cache.ring_positions.stride(0) * 8 == ring.stride(0) * 4 >= C * Di * 4 + C * 3 * 8

    g = torch.Generator().manual_seed(6)
    hid = stack.hf.hidden_size
    lengths = {"a": 70, "b": 40}
    # t, h, w apart (an image's positions are such); any int64 values are valid MRoPE positions
    rope_of = {k: torch.stack([torch.arange(n), torch.randint(0, 200, (n,), generator=g),
                               torch.randint(0, 200, (n,), generator=g)]) for k, n in lengths.items()}
    done = dict.fromkeys(lengths, 0)
    schedule = [{"a": 37, "b": 11}, {"b": 6, "a": 30}, {"a": 1, "b": 1}, {"b": 21, "a": 1}, {"a": 1, "b": 1}]
    for step in schedule:
        chunks = {k: torch.randn(n, hid, generator=g) for k, n in step.items()}
        positions = {k: rope_of[k][:, done[k]: done[k] + n] for k, n in step.items()}
        ref, mine = stack.step(chunks, rope_positions=positions)
        for k, n in step.items():
            done[k] += n
            torch.testing.assert_close(mine[k], ref[k], rtol=1e-4, atol=1e-5, msg=f"request {k}, step {step}")
    meta = stack.runner.last_metadata
    _, ring_table = common_metadata(meta, block_offset=1, ring_offset=RING_BLOCKS)
    for layer, core_cache in zip(stack.layers, stack.runner.caches):
        cache, _ = layer.indexer.layer_cache(layer.kv_cache)
        for req in range(meta.num_reqs):
            mine, theirs = cache.ring_positions[ring_table[req, 0]], core_cache.ring_positions[meta.ring_index[req]]
            assert torch.equal(mine, theirs) and (mine[:, 0] != mine[:, 1]).any()
    # positions that are not vLLM's int64 [3, >= T] are refused by name
    from qsa_adapters.vllm.backend import with_mrope_positions

    plan = stack.runner.last_plan
    T = plan.num_tokens
    assert torch.equal(with_mrope_positions(plan, torch.zeros(3, T + 2, dtype=torch.int64)).meta.rope_positions,
                       torch.zeros(3, T, dtype=torch.int64))
    for bad in (torch.zeros(3, T - 1, dtype=torch.int64), torch.zeros(2, T, dtype=torch.int64),
                torch.zeros(3, T, dtype=torch.int32)):
        with pytest.raises(ValueError, match=rf"MRoPE positions must be int64 \[3, >= {T}\]"):
            with_mrope_positions(plan, bad)


@pytest.mark.parametrize("field", ["ring_index", "slot_mapping"])
def test_a_step_past_the_allocated_caches_is_refused_by_name(stack, field):
    """The builders plan against the caches vLLM bound: a ring block or slot past them is
    refused (on a GPU, guarded inert) before any layer reads or writes there."""
    stack.runner.step({"a": torch.randn(1, stack.hf.hidden_size)})  # planned here only: vLLM never runs it
    common, ring = common_metadata(stack.runner.last_metadata, block_offset=1, ring_offset=RING_BLOCKS)
    layer = stack.layers[0]
    cache, geometry = layer.indexer.layer_cache(layer.kv_cache)
    num_rows, num_slots = cache.ring.shape[0], cache.k.shape[0] * geometry.page_size
    i = int(common.num_reqs) - 1
    if field == "ring_index":
        ring = ring.clone()
        ring[i, 0] = num_rows
        match = rf"ring_index\[{i}\] = {num_rows} is outside the ring: expected a ring row in \[0, {num_rows}\)"
    else:
        slots = common.slot_mapping.clone()
        slots[0] = num_slots
        common = common.replace(slot_mapping=slots)
        match = rf"slot_mapping\[0\] = {num_slots} is outside the cache: expected -1 or a slot in \[0, {num_slots}\)"
    with pytest.raises(ValueError, match=match):
        stack.attn_metadata(common, ring)


def test_without_step_metadata_the_layer_is_inert(stack):
    """Profiling and dummy runs carry no metadata: inert selection rows, zero output."""
    layer = stack.layers[0]
    x = torch.randn(5, stack.hf.hidden_size)
    positions = torch.arange(5)
    with torch.no_grad():
        assert torch.equal(layer(positions, x), torch.zeros(5, stack.hf.hidden_size))
        selection, prepared = layer.indexer(layer.indexer.index_qk_proj(x), positions, attn=layer)
    width = layer.indexer.packed_output_width
    assert prepared is None and selection.shape == (5, width) == (5, 16 + 4)
    assert (selection[:, :-1] == -1).all() and (selection[:, -1] == 0).all()


def test_per_micro_batch_metadata_is_refused_by_name(stack):
    """vLLM's forward context under micro-batching holds a list of per-ubatch dicts: the layer
    refuses it instead of running one micro-batch on another's plan (the first dict here is a
    real step's, which the layer would otherwise have used for both)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, stack.hf.hidden_size, generator=g)
    stack.runner.step({"mb": x})
    try:
        common, ring = common_metadata(stack.runner.last_metadata, block_offset=1, ring_offset=RING_BLOCKS)
        step = stack.attn_metadata(common, ring)
        with set_forward_context([step, step], stack.vllm_config), torch.no_grad():
            with pytest.raises(RuntimeError, match=r"list of 2 micro-batches' metadata; micro-batching \(--enable-dbo"):
                stack.layers[0](common.positions, x)
    finally:
        stack.runner.free("mb")


def test_skip_topk_keeps_the_step0_selection_while_caches_update(stack):
    """MTP steps after the first reuse the selection; the ring still takes the new raw key."""
    g = torch.Generator().manual_seed(9)
    hid = stack.hf.hidden_size
    stack.step({"d": torch.randn(30, hid, generator=g)})
    stack.runner.step({"d": torch.randn(1, hid, generator=g)})  # the next step's metadata
    meta = stack.runner.last_metadata
    common, ring = common_metadata(meta, block_offset=1, ring_offset=RING_BLOCKS)
    layer = stack.layers[0]
    idx = layer.indexer
    cache, geometry = idx.layer_cache(layer.kv_cache)
    x = torch.randn(1, hid, generator=g)
    qkv = (layer.q_proj(x), layer.k_proj(x), layer.v_proj(x))
    kept = torch.full((1, idx.packed_output_width), 7, dtype=torch.int32)
    before = cache.ring.clone()
    idx.skip_topk = True
    try:
        with set_forward_context(stack.attn_metadata(common, ring), stack.vllm_config), torch.no_grad():
            out, prepared = idx(idx.index_qk_proj(x), common.positions, kept, attn=layer, qkv=qkv)
    finally:
        idx.skip_topk = False
    assert out is kept and (kept == 7).all() and prepared is not None
    C, p = geometry.ring_capacity, int(meta.positions[0])
    changed = (cache.ring != before).any(-1).nonzero()  # (ring block, row) of each written row
    assert changed.tolist() == [[int(ring[0, 0]), p % C]]


def test_indexer_interface_and_checkpoint_names(stack):
    idx = stack.layers[1].indexer
    assert sorted(n for n, _ in idx.named_parameters()) == [
        "index_qk_proj.weight", "k_layernorm.weight", "q_layernorm.weight"]
    assert idx.prefix == "model.layers.1.self_attn.indexer" and idx.layer_id == 1
    assert (idx.output_width, idx.packed_output_width) == (19, 20)
    context = stack.vllm_config.compilation_config.static_forward_context
    assert context[f"{idx.prefix}.raw_key_cache"] is idx.raw_key_cache
    assert f"{idx.prefix}.compressed_key_cache" not in context  # it rides in the main pages
    assert context["model.layers.1.self_attn.attn"] is stack.layers[1]


def test_a_rotary_embedding_that_disagrees_is_refused(stack):
    from qsa_adapters.vllm.indexer import QSAIndexer

    rotary = stack.layers[0].rotary_emb
    bad = type("Rope", (), {"rotary_dim": rotary.rotary_dim // 2, "base": rotary.base, "is_neox_style": True})()
    with set_current_vllm_config(stack.vllm_config), pytest.raises(ValueError, match="rotary_emb.rotary_dim must be 32"):
        QSAIndexer(vllm_config=stack.vllm_config, config=stack.hf, layer_id=0, rotary_emb=bad, prefix="x.indexer")


def test_plugin_registers_backend_and_model_idempotently():
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from qsa_adapters.vllm.plugin import register

    register()
    register()
    for arch in ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration", "Qwen4ExpMTP"):
        assert ModelRegistry.models[arch].module_name == "qsa_adapters.vllm.qwen4_exp", arch
    assert "QSATinyForCausalLM" not in ModelRegistry.get_supported_archs()
    assert AttentionBackendEnum["QSA_CORE"].get_class() is QSACoreBackend


def test_our_log_lines_reach_vllms_handlers():
    """The warm-up's INFO line and the guard's errors go through vLLM's `vllm` handlers at its
    level (vLLM configures no other logger), also when vLLM configures them after the plugin
    registered; each line once."""
    import logging

    from qsa_adapters.vllm.plugin import register

    register()
    records: list[logging.LogRecord] = []
    capture = logging.Handler(logging.DEBUG)
    capture.emit = records.append
    engine = logging.getLogger("vllm")
    level = engine.level
    engine.addHandler(capture)
    engine.setLevel(logging.INFO)
    try:
        logging.getLogger("qsa_adapters.vllm.backend").info("QSA: warmed 3 kernel variants")
        logging.getLogger("qsa_core.guard").error("guard line")
        logging.getLogger("qsa_kernels.launch").debug("below vLLM's level")
    finally:
        engine.removeHandler(capture)
        engine.setLevel(level)
    assert [(r.name, r.levelname, r.getMessage()) for r in records] == [
        ("qsa_adapters.vllm.backend", "INFO", "QSA: warmed 3 kernel variants"), ("qsa_core.guard", "ERROR", "guard line")]


@pytest.mark.parametrize("setting, error, match", [
    ({"cache_dtype": "int8_per_token_head"}, ValueError,
     "QSA_CORE does not serve --kv-cache-dtype int8_per_token_head with a torch.float32 model"),
    ({"cache_dtype": "fp8", "skip_layers": ["0"]}, ValueError,
     r"QSA_CORE does not serve --kv-cache-dtype-skip-layers \(\['0'\]\) with --kv-cache-dtype fp8"),
    ({"mrope_section": [8, 4, 4], "speculative": True}, NotImplementedError,
     r"speculative decoding \(speculative_config\) with MRoPE \(rope_parameters.mrope_section\) is not served yet"),
    ({"parallel": {"enable_dbo": True}}, NotImplementedError,
     r"QSA_CORE does not serve micro-batching \(--enable-dbo\): .*; drop --enable-dbo$"),
    ({"parallel": {"ubatch_size": 2}}, NotImplementedError,
     r"QSA_CORE does not serve micro-batching \(--ubatch-size 2\): .*; drop --ubatch-size 2$"),
])
def test_unserved_settings_are_refused_by_name(stack, setting, error, match):
    """A KV-cache dtype outside the served ones, per-layer fp8 exceptions, MRoPE with
    speculative decoding, and micro-batching (vLLM's dual batch overlap, ubatches): refused
    when the core-backed layer is built, naming the setting (fp8 alone, MRoPE alone and
    --ubatch-size 1 are served). Micro-batching is refused at config time too, by the same rule."""
    from types import SimpleNamespace

    from vllm.config import ParallelConfig

    from qsa_adapters.vllm.config_hooks import refuse_microbatching
    from qsa_adapters.vllm.qwen4_exp import check_supported

    hf = tiny_config()
    if "mrope_section" in setting:
        hf.rope_parameters = dict(hf.rope_parameters, mrope_section=setting["mrope_section"], mrope_interleaved=True)
    cache = CacheConfig(block_size=PAGE, enable_prefix_caching=False, cache_dtype=setting.get("cache_dtype", "auto"),
                        kv_cache_dtype_skip_layers=setting.get("skip_layers", []))
    vc = VllmConfig(model_config=stack.vllm_config.model_config, cache_config=cache)
    with set_current_vllm_config(vc):
        if setting.get("speculative"):
            check_supported(vc, hf)  # MRoPE alone passes
            # check_supported reads whether speculative_config is set; a real one needs a draft model
            vc = SimpleNamespace(cache_config=cache, model_config=vc.model_config, parallel_config=vc.parallel_config,
                                 speculative_config=object())
        if "skip_layers" in setting:
            check_supported(VllmConfig(model_config=vc.model_config, cache_config=CacheConfig(
                block_size=PAGE, enable_prefix_caching=False, cache_dtype="fp8")), hf)  # fp8 alone passes
        if "parallel" in setting:
            # a VllmConfig with micro-batching on is refused while it is built (`refuse_microbatching`
            # in vLLM's config hook, the server test): the rules get vLLM's own ParallelConfig
            def with_parallel(**fields):
                return SimpleNamespace(cache_config=cache, model_config=vc.model_config, speculative_config=None,
                                       attention_config=vc.attention_config, parallel_config=ParallelConfig(**fields))

            check_supported(with_parallel(ubatch_size=1), hf)  # one ubatch: no micro-batching
            refuse_microbatching(with_parallel(ubatch_size=1))
            vc = with_parallel(**setting["parallel"])
            with pytest.raises(ValueError, match=match):
                refuse_microbatching(vc)
        with pytest.raises(error, match=match):
            check_supported(vc, hf)


@pytest.mark.parametrize("cache_dtype, core, view", [
    ("fp8", "fp8_e4m3", torch.float8_e4m3fn), ("fp8_e4m3", "fp8_e4m3", torch.float8_e4m3fn),
    ("fp8_e5m2", "fp8_e5m2", torch.float8_e5m2),
])
def test_fp8_pages_are_the_cores_float8_kv_with_the_layers_scales(cache_dtype, core, view):
    """vLLM's fp8 main K/V pages (uint8, one byte per element, compressed rows behind in the
    model dtype) are viewed as the core's float8 dtype over the same bytes, with the layer's
    scales; a scale that is not a positive finite float is refused by name."""
    from qsa_adapters.vllm.cache import bind_layer_cache, core_kv_cache_dtype, main_kv_spec

    assert core_kv_cache_dtype(cache_dtype, torch.float32) == core
    cfg = QSAConfig.from_hf(tiny_config(), kv_cache_dtype=core)
    vc = VllmConfig(cache_config=CacheConfig(block_size=PAGE, cache_dtype=cache_dtype))
    spec = main_kv_spec(vc, cfg, torch.float32, torch.float32)
    kv_bytes = PAGE * 2 * 2 * 64  # Hkv 2, K and V of D 64, one byte each
    assert spec.dtype == torch.uint8 and spec.page_size_bytes == kv_bytes + PAGE // 4 * 64 * 4
    pages = torch.zeros(3, spec.page_size_bytes, dtype=torch.uint8)
    kv = pages[:, :kv_bytes].view(3, 2, PAGE, 128)  # vLLM's view [blocks, Hkv, page, 2D]
    ring = torch.zeros(2, 1, 4, 64)
    cache, _ = bind_layer_cache(kv, ring, cfg, torch.float32, torch.float32, 0.5, 3.0)
    assert cache.k.dtype == cache.v.dtype == view and (cache.k_scale, cache.v_scale) == (0.5, 3.0)
    cache.k[1, 5, 1, 7] = 2.0  # block 1, slot 5, KV head 1, dim 7: the page's byte there
    assert kv[1, 1, 5, 7].item() == torch.tensor(2.0, dtype=view).view(torch.uint8).item()
    cache.v[1, 5, 1, 7] = -1.0  # V is the second half of the last dim
    assert kv[1, 1, 5, 64 + 7].item() == torch.tensor(-1.0, dtype=view).view(torch.uint8).item()
    for bad in (0.0, float("inf"), -1.0):
        with pytest.raises(ValueError, match="v_scale must be a positive finite float"):
            bind_layer_cache(kv, ring, cfg, torch.float32, torch.float32, 1.0, bad)


def test_specs_follow_the_block_size_vllm_settles_on(stack):
    """design.md §6.11: vLLM raises the block size of hybrid models after the model is built; the
    main page (with its compressed rows) and the ring are specified from the size asked with."""
    layer = stack.layers[0]
    vc = stack.vllm_config
    for block_size in (16, 144, 272):
        cache = CacheConfig(block_size=block_size, enable_prefix_caching=False)
        asked = VllmConfig(model_config=vc.model_config, cache_config=cache)
        main = layer.get_kv_cache_spec(asked)
        ring = layer.indexer.raw_key_cache.get_kv_cache_spec(asked)
        kv_bytes = block_size * 2 * 2 * 64 * 4  # Hkv 2, K and V of D 64, fp32
        assert main.block_size == block_size
        assert main.page_size_bytes == kv_bytes + block_size // 4 * 64 * 4  # + page/r rows of Di 64
        assert ring.block_size == 4 and block_size % ring.block_size == 0
    with pytest.raises(ValueError, match="block_size \\(18\\) must be a multiple of compress_ratio"):
        layer.get_kv_cache_spec(VllmConfig(model_config=vc.model_config, cache_config=CacheConfig(
            block_size=18, enable_prefix_caching=False)))
    layer.indexer.raw_key_cache.get_kv_cache_spec(vc)  # the bound caches' spec again


def test_caches_bound_anew_are_planned_against_their_own_bounds(stack):
    """vLLM captures CUDA graphs against a throw-away minimal cache and then binds the real one:
    steps after that are planned against the caches bound now (a slot of the real cache past the
    first one's end runs; with the first cache's bounds it would be refused, on a GPU made inert)."""
    for rid in stack.runner.request_ids:
        stack.runner.free(rid)
    hid = stack.hf.hidden_size
    g = torch.Generator().manual_seed(11)
    try:
        small = stack.bind(6 << 20)
        stack.step({"s": torch.randn(3, hid, generator=g)})  # planned against the small caches
        stack.runner.free("s")
        large = stack.bind(12 << 20)
        assert large > small + NUM_PAGES, (small, large)
        for n in (21, 1, 1):  # every main page lies past the small cache's blocks
            chunks = {"t": torch.randn(n, hid, generator=g)}
            ref, mine = stack.step(chunks, block_offset=small)
            torch.testing.assert_close(mine["t"], ref["t"], rtol=1e-4, atol=1e-5)
            assert ref["t"].abs().amax() > 0
    finally:
        for rid in stack.runner.request_ids:
            stack.runner.free(rid)
        stack.bind()


def test_each_new_mapper_is_warmed_on_its_geometry_caches(stack, monkeypatch):
    """Start-up warm-up: every mapper the pairing builds (at the first step, and again when
    vLLM binds new caches) warms its planner on the layer caches of its geometry, with decode
    query lengths 1 and the builder's decode threshold; on the CPU's reference backend the
    warm-up compiles nothing and logs nothing."""
    from qsa_adapters.vllm import backend

    calls, real = [], backend.start_up_warm

    def spy(planner, caches, *, decode_query_lens):
        calls.append((planner, list(caches), tuple(decode_query_lens)))
        out = real(planner, caches, decode_query_lens=decode_query_lens)
        assert out is None and planner.backend.name == "reference"
        return out

    monkeypatch.setattr(backend, "start_up_warm", spy)
    for rid in stack.runner.request_ids:
        stack.runner.free(rid)
    hid = stack.hf.hidden_size
    g = torch.Generator().manual_seed(13)
    try:
        for i, kv_bytes in enumerate((6 << 20, 8 << 20)):
            stack.bind(kv_bytes)
            stack.step({f"w{i}": torch.randn(3, hid, generator=g)})
            stack.step({f"w{i}": torch.randn(1, hid, generator=g)})  # no new mapper: no new warm-up
            stack.runner.free(f"w{i}")
            pairing = backend.QSAStepPairing.of(stack.vllm_config, torch.device("cpu"))
            (geometry, mapper), = pairing.mappers.items()
            planner, caches, lens = calls[-1]
            assert planner is mapper.planner
            bound = [layer.indexer.layer_cache(layer.kv_cache)[0] for layer in stack.layers]
            assert [c.k.data_ptr() for c in caches] == [c.k.data_ptr() for c in bound]
            assert lens == (1, pairing.decode_threshold)
        assert len(calls) == 2
    finally:
        for rid in stack.runner.request_ids:
            stack.runner.free(rid)
        stack.bind()


def test_a_request_the_device_guards_flag_is_logged_a_step_later(stack, monkeypatch):
    """The builders' GuardWatch (no value checks: a GPU's default path, on the reference build's
    flag): a step whose requests 0 and 1 share a ring block is made inert and flagged; the
    next step's build logs both, by batch index, and the reason."""
    from qsa_adapters.vllm.backend import QSAStepPairing

    g = torch.Generator().manual_seed(11)
    hid = stack.hf.hidden_size
    scratch = Runner(stack.runner.layers, page_size=PAGE, num_pages=NUM_PAGES, max_requests=4)  # metadata only
    scratch.step({"x": torch.randn(3, hid, generator=g), "y": torch.randn(5, hid, generator=g)})
    common, ring = common_metadata(scratch.last_metadata, block_offset=1, ring_offset=RING_BLOCKS)
    stack.attn_metadata(common, ring)  # the mappers exist from here
    pairing = QSAStepPairing.of(stack.vllm_config, torch.device("cpu"))
    for mapper in pairing.mappers.values():
        monkeypatch.setattr(mapper.planner, "_read_values", False)
    logged = []
    monkeypatch.setattr(pairing.guard_watch, "log", logged.append)
    pairing.guard_watch.poll(next(iter(pairing.mappers.values())).planner, 0)  # what earlier tests left
    logged.clear()
    shared = ring.clone()
    shared[1, 0] = shared[0, 0]
    stack.attn_metadata(common.replace(query_start_loc=common.query_start_loc.clone()), shared)
    assert logged == []  # copied after the plan, read at the next build
    stack.attn_metadata(common.replace(query_start_loc=common.query_start_loc.clone()), ring)
    (report,) = logged
    assert "ring_index entry was another request's with rows too" in report
    assert "request '#0 of step" in report and "request '#1 of step" in report


def test_a_draft_only_builder_plans_build_as_a_draft_step_on_the_target_steps_rings(stack, monkeypatch):
    """vLLM 0.33's GPU runner builds the speculator's draft steps with `build` on builders of
    the draft layers alone (vLLM 0.32 calls `build_for_drafting`): such a builder plans a
    draft step on the last target step's ring blocks. A draft step padded to more requests
    than that step (vLLM 0.33 captures its draft graphs of 4 requests after a target graph of
    1) gives the padding requests ring block 0, and leaves the target step's table as it was."""
    from qsa_adapters.vllm.backend import QSAStepPairing

    g = torch.Generator().manual_seed(17)
    hid = stack.hf.hidden_size
    scratch = Runner(stack.runner.layers, page_size=PAGE, num_pages=NUM_PAGES, max_requests=4)  # metadata only
    scratch.step({"x": torch.randn(3, hid, generator=g), "y": torch.randn(5, hid, generator=g)})
    common, ring = common_metadata(scratch.last_metadata, block_offset=1, ring_offset=RING_BLOCKS)
    scratch.step({"x": torch.randn(1, hid, generator=g), "y": torch.randn(1, hid, generator=g)})
    decode, decode_ring = common_metadata(scratch.last_metadata, block_offset=1, ring_offset=RING_BLOCKS)
    assert torch.equal(decode_ring, ring)
    pairing = QSAStepPairing.of(stack.vllm_config, torch.device("cpu"))

    (main_names, main_builder), = [(n, b) for n, b in stack.groups if not b.is_ring]
    assert not main_builder.is_draft
    context = stack.vllm_config.compilation_config.static_forward_context
    for name in main_names:
        monkeypatch.setattr(context[name], "is_draft_layer", True, raising=False)
    draft = QSAStepMetadataBuilder(main_builder.kv_cache_spec, main_names, stack.vllm_config, torch.device("cpu"))
    assert draft.is_draft

    def ring_rows(record, n):
        (plan,) = record.step.records.values()
        return plan.meta.ring_index[:n].tolist()

    target = stack.attn_metadata(decode, ring)[main_names[0]]  # a target step on these rings
    expected = ring_rows(target, 2)
    assert 0 not in expected
    stack.attn_metadata(common, ring)
    assert ring_rows(draft.build(0, decode.replace(query_start_loc=decode.query_start_loc.clone())), 2) == expected

    held = ring[:1].clone()
    pairing.last_ring_block_table = held  # the last target step held request x only
    assert ring_rows(draft.build(0, decode.replace(query_start_loc=decode.query_start_loc.clone())), 2) == [
        expected[0], 0]
    assert torch.equal(held, ring[:1]) and torch.equal(pairing.last_ring_block_table, ring[:1])
    pairing.last_ring_block_table = ring  # a full target step after a padded draft: its own rings again
    assert ring_rows(draft.build(0, decode.replace(query_start_loc=decode.query_start_loc.clone())), 2) == expected
    stack.attn_metadata(common, ring)  # leave the pairing on a target step
