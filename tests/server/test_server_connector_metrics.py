"""The KV connector's counters reach /metrics as pdserve:kv_connector_* with their labels."""

from pdserve.runtime.metrics import ServerMetrics, parse_samples


def test_connector_counters_are_exported_with_labels():
    m = ServerMetrics("model-x")
    m.set_connector_metrics({"kv_load_failures{kind=missing}": 2, "kv_load_failures{kind=corrupt}": 1,
                             "kv_blocks_loaded": 5, "kv_leases_active": 3})
    text = m.render().decode()
    samples = parse_samples(text)
    assert samples['pdserve:kv_connector_load_failures_total{kind="missing",model_name="model-x"}'] == 2
    assert samples['pdserve:kv_connector_load_failures_total{kind="corrupt",model_name="model-x"}'] == 1
    assert samples['pdserve:kv_connector_blocks_loaded_total{model_name="model-x"}'] == 5
    assert samples['pdserve:kv_connector_leases_active{model_name="model-x"}'] == 3
    assert "# TYPE pdserve:kv_connector_leases_active gauge" in text
    # One family per name: the engine's own pdserve:kv_load_failures stays distinct.
    assert text.count("# TYPE pdserve:kv_load_failures_total counter") == 1


def test_connector_snapshot_replaces_the_previous_one():
    m = ServerMetrics("m")
    m.set_connector_metrics({"kv_blocks_saved": 1})
    m.set_connector_metrics({"kv_blocks_saved": 4})
    assert parse_samples(m.render().decode())['pdserve:kv_connector_blocks_saved_total{model_name="m"}'] == 4
