"""scripts/vllm_stage/fatbin_prune.py zeroes exactly the cubins of other architectures: PTX,
the kept cubins, every other byte and the file's size stay."""
import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "vllm_stage"))
import fatbin_prune  # noqa: E402


def entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, kind, 0, 64, len(payload))
    struct.pack_into("<I", header, 28, arch)
    return bytes(header) + payload


def library() -> tuple[bytes, dict]:
    payloads = {"ptx80": b"p" * 100, "elf90": b"a" * 200, "elf80": b"b" * 300}
    body = (entry(1, 80, payloads["ptx80"]) + entry(2, 90, payloads["elf90"])
            + entry(2, 80, payloads["elf80"]))
    fat = fatbin_prune.MAGIC + struct.pack("<HHQ", 1, 16, len(body)) + body
    # the magic bytes also stand once where no fatbin starts
    return b"\x7fELF" + bytes(40) + fatbin_prune.MAGIC + b"junk" + fat + b"tail" * 8, payloads


def test_prune_zeroes_only_the_cubins_of_other_architectures(tmp_path, capsys):
    lib, payloads = library()
    (tmp_path / "lib.so").write_bytes(lib)
    fatbin_prune.main(["prune", str(tmp_path / "lib.so"), str(tmp_path / "out.so"), "90"])
    out = (tmp_path / "out.so").read_bytes()
    assert len(out) == len(lib)
    assert payloads["ptx80"] in out and payloads["elf90"] in out
    at = lib.index(payloads["elf80"])
    assert out[at:at + 300] == bytes(300)
    assert out[:at] == lib[:at] and out[at + 300:] == lib[at + 300:]  # nothing else changed
    report = capsys.readouterr().out
    assert "in 3 entries" in report and "zeroed 0.0 MB of cubins not in [90]" in report


def test_listing_counts_each_kind_and_architecture(tmp_path, capsys):
    lib, _ = library()
    (tmp_path / "lib.so").write_bytes(lib)
    fatbin_prune.main(["list", str(tmp_path / "lib.so")])
    report = capsys.readouterr().out
    for key in ("ptx_sm80     n=    1", "elf_sm90     n=    1", "elf_sm80     n=    1"):
        assert key in report
