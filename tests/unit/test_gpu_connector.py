"""scripts/gpu_connector.py without a GPU: how arms are compared and how a staged vLLM finds
the plugin (the GPU run is the committed result under benchmarks/results/)."""
import importlib.metadata as md
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import gpu_connector  # noqa: E402


def out(tokens, logprobs):
    return dict(tokens=tokens, logprobs=logprobs)


def test_outputs_are_matched_by_request_index_and_compared_bit_for_bit():
    resident = {"batch-0": out([5, 6], [-0.5, -0.25]), "batch-1": out([7], [-1.0]),
                "batch-2": out([8], [-2.0])}
    same = {"batch_again-0": out([5, 6], [-0.5, -0.25]), "batch_again-1": out([7], [-1.0]),
            "batch_again-2": None}  # aborted: not compared
    got = gpu_connector.compare_outputs(same, resident)
    assert got == dict(compared=2, tokens_differ=[], logprobs_differ=[], max_logprob_diff=0.0,
                       identical=True)
    off = {"batch-0": out([5, 6], [-0.5, -0.25 + 2**-30]), "batch-1": out([9], [-1.0])}
    got = gpu_connector.compare_outputs(off, resident)
    assert got["tokens_differ"] == ["batch-1"] and got["logprobs_differ"] == ["batch-0"]
    assert 0 < got["max_logprob_diff"] < 1e-8 and not got["identical"]


def test_a_scenario_that_failed_in_either_arm_is_not_identical():
    a = {"scenarios": {"batch": {"outputs": {"batch-0": out([1], [0.0])}},
                       "abort": {"error": "RuntimeError: x"}}}
    b = {"scenarios": {"batch": {"outputs": {"batch-0": out([1], [0.0])}},
                       "abort": {"outputs": {}}}}
    got = gpu_connector.compare(a, b)
    assert got["batch"]["identical"] and not got["abort"]["identical"]
    assert got["abort"]["error"] == "RuntimeError: x"


def test_a_staged_vllm_finds_the_plugin_through_the_written_entry_point(monkeypatch):
    def not_installed(name):
        raise md.PackageNotFoundError(name)
    monkeypatch.setattr(md, "distribution", not_installed)
    where = gpu_connector.plugin_path()
    code = ("import importlib.metadata as md; print([e.value for e in "
            "md.entry_points(group='vllm.general_plugins') if e.name == 'dhisparse'])")
    got = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": where})
    assert got.stdout.strip() == "['vllm_dhisparse.integration.plugin:register']", got.stderr


def test_the_measured_connector_is_recognised_and_only_it_passes_the_audit_refusals():
    """gpu_measure.MeasuredConnector is the connector (its subclass, by module path) and the
    only one that lets unaudited CUDA configurations through; by default the scripts run
    the package's own class."""
    import gpu_measure
    from vllm.config import KVTransferConfig

    from vllm_dhisparse.integration.connector import DHiSparseConnector
    from vllm_dhisparse.integration.extension_points import apply_all
    from vllm_dhisparse.integration.support import uses_connector
    apply_all()
    ktc = KVTransferConfig(**gpu_measure.engine_args({"hot_cache_rows": 512},
                                                     unaudited=True)["kv_transfer_config"])
    assert uses_connector(ktc) and ktc.kv_connector == "MeasuredConnector"
    assert gpu_measure.MeasuredConnector.measures_unaudited
    assert not DHiSparseConnector.measures_unaudited
    args = gpu_measure.server_args({}, unaudited=True)
    assert '"kv_connector_module_path": "gpu_measure"' in args[1]
    package = gpu_measure.engine_args({"hot_cache_rows": 512})["kv_transfer_config"]
    assert package["kv_connector"] == "DHiSparseConnector"
    assert not package.get("kv_connector_module_path")
    assert "gpu_measure" not in " ".join(gpu_measure.server_args({}))
