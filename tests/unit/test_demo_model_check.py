"""The demo's trained model is checked against its SHA256SUMS before any server starts:
a changed byte names the file and how to restore it."""
import hashlib

import pytest

from vllm_dhisparse import demo


def test_a_changed_file_is_named(tmp_path):
    for name, data in (("a.safetensors", b"weights"), ("config.json", b"{}")):
        (tmp_path / name).write_bytes(data)
    (tmp_path / "SHA256SUMS").write_text("".join(
        f"{hashlib.sha256((tmp_path / n).read_bytes()).hexdigest()}  {n}\n"
        for n in ("a.safetensors", "config.json")))
    assert demo.verified_model(str(tmp_path)) == str(tmp_path)
    (tmp_path / "a.safetensors").write_bytes(b"weightz")
    with pytest.raises(SystemExit, match=r"a\.safetensors: SHA-256 .* does not match"):
        demo.verified_model(str(tmp_path))
    (tmp_path / "SHA256SUMS").unlink()
    with pytest.raises(SystemExit, match="SHA256SUMS is missing"):
        demo.verified_model(str(tmp_path))
