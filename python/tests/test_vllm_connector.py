"""KvxferConnector against the real vLLM 0.33.0: the abstract interface and constructor, the
factory loading it by module path, the real Scheduler driving the scheduler-side hooks, and a
two-process handoff through the worker-side methods moving CPU KV tensors (laid out by vLLM's
own create_kv_cache_views) in NHD and HND, byte-exact."""

import inspect
import multiprocessing as mp
import os
import sys
import traceback

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import helpers as h  # noqa: E402

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvxfer_vllm import KvxferConnector  # noqa: E402


def test_subclass_satisfies_the_abstract_interface():
    assert issubclass(KvxferConnector, KVConnectorBase_V1)
    assert not inspect.isabstract(KvxferConnector), KvxferConnector.__abstractmethods__
    _, _, kv = h.kv_caches()
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        c = KvxferConnector(h.vllm_config(), role, kv)
        assert c.role == role
        c.shutdown()


def test_sleep_mode_is_refused_not_served_with_stale_registrations():
    # The base class says True; kvxfer cannot follow sleep mode's remap yet (issue 35), so
    # vLLM's config check (VllmConfig, enable_sleep_mode) refuses the pair at start.
    cfg = h.vllm_config(role="kv_both", extra={"transport": "tcp", "net_devices": "lo"})
    assert KVConnectorBase_V1.supports_sleep_mode(cfg.kv_transfer_config) is True
    assert KvxferConnector.supports_sleep_mode(cfg.kv_transfer_config) is False
    cls = KVConnectorFactory.get_connector_class(cfg.kv_transfer_config)
    assert cls.supports_sleep_mode(cfg.kv_transfer_config) is False
    # vLLM's own check, as it runs at start with sleep mode on.
    cfg.model_config.enable_sleep_mode = True
    with pytest.raises(ValueError, match="does not support sleep mode"):
        cfg._verify_kv_transfer_compat()


def test_vllm_resolves_the_kv_cache_layout_kvxfer_asks_for():
    # vLLM's own resolver, as the engine core runs it with the backends' supported sets: with
    # kvxfer configured it picks LBHNC where a backend offers it, ahead of its default LBNHC.
    from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    vc = h.vllm_config()
    assert KvxferConnector.get_required_kvcache_layout(vc) == "LBHNC"
    assert get_kv_connector_cache_layout(vc) == "LBHNC"
    assert resolve_kv_cache_layout(vc, [["LBNHC", "LBHNC"]]).name == "LBHNC"
    assert vc.cache_config.kv_cache_layout == "LBHNC"
    # A backend without it: vLLM keeps its own (and warns); register_kv_caches takes both.
    vc = h.vllm_config()
    assert resolve_kv_cache_layout(vc, [["LBNHC"]]).name == "LBNHC"
    # MLA (ModelConfig.use_mla, a property of the model's architecture): no head dimension,
    # no preference.
    from types import SimpleNamespace

    mla = SimpleNamespace(model_config=SimpleNamespace(use_mla=True))
    assert KvxferConnector.get_required_kvcache_layout(mla) is None


def test_loaded_tokens_count_as_peer_to_peer_cache_hits():
    # vLLM's cache-hit metrics split external tokens by tier: kvxfer's are another engine's.
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _, _, kv = h.kv_caches()
    c = KvxferConnector(h.vllm_config(role="kv_consumer"), KVConnectorRole.SCHEDULER, kv)
    r = h.request("hit", 40, {"do_remote_prefill": True}, max_tokens=1)
    assert c.get_external_cache_hit_sources(r, 40) == {CacheHitSource.P2P: 40}
    assert c.get_external_cache_hit_sources(r, 0) == {}
    c.shutdown()


def test_factory_loads_it_by_module_path_in_both_roles():
    vc = h.vllm_config()
    assert KVConnectorFactory.get_connector_class(vc.kv_transfer_config) is KvxferConnector
    _, caches, kv = h.kv_caches()
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        c = KVConnectorFactory.create_connector(vc, role, kv)
        assert isinstance(c, KvxferConnector)
        if role == KVConnectorRole.WORKER:
            c.register_kv_caches(caches)
            text = c.prometheus_text()
            assert "kvxfer_requests_total" in text
            assert "kvxfer_budget_used_bytes{agent=" in text
        c.shutdown()


_output = h.model_output


def test_real_scheduler_skips_what_the_connector_loads():
    _, _, kv = h.kv_caches()
    s = h.scheduler(h.vllm_config(), kv)
    # A request handed over from a prefill engine: the connector reports the whole prompt as
    # loadable, so the scheduler computes none of it and parks the request until loaded.
    r = h.request("dec-1", 40, {"do_remote_prefill": True, "kvxfer_handoff": '{"request":"p-1"}'})
    s.add_request(r)
    out = s.schedule()
    assert "dec-1" not in out.num_scheduled_tokens
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    meta = out.kv_connector_metadata
    handoff, local, report, seal = meta.loads["dec-1"]
    assert seal is None  # no secret, no seal
    # One KV cache group: 40 tokens in 16-token blocks.
    assert len(local) == 1 and len(local[0]) == 3 and report
    # The worker reports it loaded: only the last prompt token is computed, not 40.
    s.update_from_output(out, _output(out, kv=KVConnectorOutput(finished_recving={"dec-1"})))
    out2 = s.schedule()
    assert out2.num_scheduled_tokens.get("dec-1", 0) <= 1, out2.num_scheduled_tokens
    assert r.num_computed_tokens >= 39


def test_real_scheduler_prefill_side_delays_free_and_returns_a_handoff():
    vc = h.vllm_config(role="kv_both")
    raw, caches, kv = h.kv_caches()
    worker = KvxferConnector(vc, KVConnectorRole.WORKER, kv)
    worker.register_kv_caches(caches)
    s = h.scheduler(vc, kv)
    # As EngineCore does after the workers registered their caches: no shared folder.
    assert worker.template_path is None
    s.connector.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
    r = h.request("pre-1", 40, {"do_remote_decode": True}, max_tokens=1)
    s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens["pre-1"] == 40
    eco = s.update_from_output(out, _output(out, sampled=7))
    outs = [o for v in eco.values() for o in v.outputs]
    params = outs[0].kv_transfer_params
    assert params["do_remote_prefill"] and "kvxfer_handoff" in params
    # The blocks stay held for the consumer: the next step publishes them on the worker.
    out2 = s.schedule()
    assert "pre-1" in out2.kv_connector_metadata.publishes
    worker.bind_connector_metadata(out2.kv_connector_metadata)
    worker.start_load_kv(None)
    worker.clear_connector_metadata()
    worker.shutdown()


def _prefill_proc(layout, conn, engine_id):
    try:
        vc = h.vllm_config(role="kv_producer", engine_id=engine_id)
        raw, caches, kv = h.kv_caches(layout=layout)
        g = torch.Generator().manual_seed(11)
        raw.copy_(torch.randint(-128, 127, raw.shape, dtype=torch.int8, generator=g))
        worker = KvxferConnector(vc, KVConnectorRole.WORKER, kv)
        worker.register_kv_caches(caches)
        s = h.scheduler(vc, kv)
        s.connector.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
        r = h.request("pre-2", 70, {"do_remote_decode": True}, max_tokens=1)
        s.add_request(r)
        out = s.schedule()
        eco = s.update_from_output(out, _output(out, sampled=5))
        params = [o for v in eco.values() for o in v.outputs][0].kv_transfer_params
        blocks = [b for b in s.kv_cache_manager.get_block_ids("pre-2")[0]]
        out2 = s.schedule()
        worker.bind_connector_metadata(out2.kv_connector_metadata)
        worker.start_load_kv(None)
        worker.clear_connector_metadata()
        conn.send((params, blocks, {n: t.clone() for n, t in caches.items()}))
        # Serve until the consumer acknowledged: then the scheduler frees the blocks.
        import time

        end = time.time() + 60
        done = set()
        while time.time() < end and "pre-2" not in done:
            sending, _ = worker.get_finished({"pre-2"})
            done |= sending or set()
            time.sleep(0.01)
        conn.send(("freed", sorted(done)))
        worker.shutdown()
    except Exception:
        conn.send(("error", traceback.format_exc()))


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_two_process_handoff_through_the_worker_methods(layout):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    engine = f"kvx-prefill-{layout}-{os.getpid()}"
    p = ctx.Process(target=_prefill_proc, args=(layout, child, engine))
    p.start()
    msg = parent.recv()
    assert msg[0] != "error", msg[1]
    params, remote_blocks, remote_caches = msg

    vc = h.vllm_config(role="kv_consumer")
    raw, caches, kv = h.kv_caches(layout=layout)
    worker = KvxferConnector(vc, KVConnectorRole.WORKER, kv)
    worker.register_kv_caches(caches)
    s = h.scheduler(vc, kv)
    r = h.request("dec-2", 70, dict(params), max_tokens=4)
    s.add_request(r)
    out = s.schedule()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    worker.bind_connector_metadata(out.kv_connector_metadata)
    worker.start_load_kv(None)
    worker.clear_connector_metadata()
    local = out.kv_connector_metadata.loads["dec-2"][1][0]
    import time

    end = time.time() + 60
    recv = set()
    while time.time() < end and "dec-2" not in recv:
        _, rv = worker.get_finished(set())
        recv |= rv or set()
        time.sleep(0.01)
    assert "dec-2" in recv
    assert worker.get_block_ids_with_load_errors() == set()
    assert len(local) == len(remote_blocks) == 5
    for name, t in caches.items():
        for lb, rb in zip(local, remote_blocks):
            assert torch.equal(t[lb].view(torch.int16), remote_caches[name][rb].view(torch.int16)), (name, lb, rb)
    stats = worker.get_kv_connector_stats()
    assert stats.data["loads"] == 1 and stats.data["bytes_moved"] == 5 * h.LAYERS * 2 * h.KV_HEADS * h.BLOCK * h.HEAD * 2
    # The producer saw the acknowledgement and reported the blocks sent.
    freed = parent.recv()
    assert freed == ("freed", ["pre-2"]), freed
    p.join(30)
    worker.shutdown()


def test_in_process_connector_through_the_same_bindings():
    """A second implementation of the connector traits (kvxfer's in-process one) reached from
    Python through the bindings the plugin uses: bytes land, a cached prefix stays, the
    producer frees on the acknowledgement."""
    from kvxfer_vllm import lib as kx

    layers, heads, head_dim, bs, nb = 2, 2, 8, 4, 8
    src = torch.randint(0, 255, (layers, nb, heads, bs, 2 * head_dim), dtype=torch.uint8).to(torch.bfloat16)
    dst = torch.zeros_like(src)
    per_layer = nb * heads * bs * 2 * head_dim * 2
    lay, _ = kx.layout_struct(layers, heads, head_dim, 2, bs, nb, kx.KVX_PACKING_FUSED, False, [(0, 0, None, 0)] * layers)
    cfg = kx.config_struct(heartbeat_ms=20)
    conn = kx.Connector.in_process()
    prod = conn.producer(lay, [(src[i].data_ptr(), per_layer) for i in range(layers)], cfg)
    cons = conn.consumer(lay, [(dst[i].data_ptr(), per_layer) for i in range(layers)], cfg)
    handoff = prod.publish("py-1", [1, 4, 6], 12, layers)
    cons.start_load(handoff, [2, 7])  # block 1 is a cached prefix
    cons.wait("py-1", 20000)
    assert torch.equal(dst[:, 2], src[:, 4]) and torch.equal(dst[:, 7], src[:, 6])
    assert torch.count_nonzero(dst[:, [0, 1, 3, 4, 5, 6]]) == 0
    name, st = cons.next_finished()
    assert name == "py-1" and st["bytes_moved"] == 2 * layers * (per_layer // nb)
    freed = prod.next_freed(20000)
    assert freed[0] == "py-1" and list(freed[1]) == [1, 4, 6] and freed[2] == 0
    cons.close()
    prod.close()
    conn.close()


def test_the_side_channel_advertises_the_chosen_interfaces_address():
    from kvxfer_vllm.connector import _advertised_host, iface_ipv4

    assert iface_ipv4("lo") == "127.0.0.1"
    assert iface_ipv4("no-such-if0") is None
    assert _advertised_host({"net_devices": "lo"}) == "127.0.0.1"
    assert _advertised_host({"host": "198.18.0.7", "net_devices": "lo"}) == "198.18.0.7"
    others = [d for d in os.listdir("/sys/class/net") if d != "lo" and iface_ipv4(d)]
    for d in others:
        # The README's "net_devices": "eth0" advertises eth0's address, not 127.0.0.1.
        assert _advertised_host({"net_devices": d}) == iface_ipv4(d) != "127.0.0.1"
    # And a worker's template (what every handoff carries) uses it.
    vc = h.vllm_config(extra={"transport": "tcp", "net_devices": others[0] if others else "lo"})
    _, caches, kv = h.kv_caches()
    w = KvxferConnector(vc, KVConnectorRole.WORKER, kv)
    w.register_kv_caches(caches)
    side = w.get_handshake_metadata().template["side_channel"]
    assert side.startswith((iface_ipv4(others[0]) if others else "127.0.0.1") + ":"), side
    w.shutdown()


def test_kv_buffer_device_cpu_maps_to_the_bounded_staged_path():
    from kvxfer_vllm.connector import gpu_path_for

    assert gpu_path_for("cpu", {}) == "staged"
    assert gpu_path_for("cuda", {}) is None
    assert gpu_path_for("cpu", {"gpu_path": "direct"}) == "direct"  # an explicit choice wins
    # Accepted by the real config and a worker with host caches (nothing to stage there).
    vc = h.vllm_config()
    vc.kv_transfer_config.kv_buffer_device = "cpu"
    _, caches, kv = h.kv_caches()
    w = KvxferConnector(vc, KVConnectorRole.WORKER, kv)
    w.register_kv_caches(caches)
    assert "kvxfer_requests_total" in w.prometheus_text()
    w.shutdown()


def test_figures_reach_vllms_own_prometheus_registry():
    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    vc = h.vllm_config()
    prom = KVConnectorProm(vc, labelnames=["model_name", "engine"], per_engine_labelvalues={0: ["tiny", "0"]})
    assert type(prom.prom_metrics).__name__ == "KvxferPromMetrics"
    stats = KvxferConnector.build_kv_connector_stats({"loads": 2, "failed": 1, "bytes_moved": 4096, "bytes_skipped": 1024, "handoff_s": 0.5})
    prom.observe(stats.to_dict(), 0)
    text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert 'vllm:kvxfer_bytes_moved_total{engine="0",model_name="tiny"} 4096.0' in text, text[-2000:]
    assert 'vllm:kvxfer_load_failures_total{engine="0",model_name="tiny"} 1.0' in text


@pytest.mark.parametrize("layout", ["BLNHC", "BLHNC"])
def test_block_outermost_layouts_are_refused_naming_the_fix(layout):
    """vLLM's block-outermost layouts (a block's pages of every layer side by side, so a layer's
    blocks are not contiguous) are refused at registration, naming the layout setting that
    works, before anything is registered or advertised."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    cfg, spec, _ = h.kv_cache_config(layout=layout)
    nb, page = cfg.num_blocks, spec.page_size_bytes
    lay = KVCacheLayout[layout]
    outer = lay.value[0] == 1  # B outermost: a block's pages of every layer side by side
    tensor = KVCacheTensor(
        size=page * nb * h.LAYERS,
        layers=h.layer_names(),
        layer_stride=page if outer else page * nb,
        block_stride=page * h.LAYERS if outer else page,
    )
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, nb, lay, tensor)
    w = KvxferConnector(h.vllm_config(), KVConnectorRole.WORKER, cfg)
    with pytest.raises(ValueError) as e:
        w.register_kv_caches(dict(zip(h.layer_names(), views)))
    assert "VLLM_KV_CACHE_LAYOUT=LBNHC or LBHNC" in str(e.value), str(e.value)
    assert w.agent is None and w.get_handshake_metadata() is None
    w.shutdown()
