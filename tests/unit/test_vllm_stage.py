"""scripts/vllm_stage: archives packed into parts (pack.py) come back whole when the parts are
unpacked one call at a time in any order (stage.sh), a damaged part is named and never
unpacked, a JIT cache carried in any part folder is restored, and nothing is READY before a
part has arrived.  Packing reads its archives only: it can be run again."""
import io
import os
import subprocess
import sys
import tarfile

import pytest

STAGE = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "vllm_stage")


def archive(path, files: dict[str, bytes], mode: str) -> None:
    with tarfile.open(path, mode) as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


PART_MIB = 2.5


def pack(arch, carry, part_mib=PART_MIB):
    return subprocess.run([sys.executable, os.path.join(STAGE, "pack.py"), str(arch), str(carry)],
                          env={**os.environ, "PART_MIB": str(part_mib)}, capture_output=True,
                          text=True)


@pytest.fixture
def parts(tmp_path):
    arch = tmp_path / "arch"
    arch.mkdir()
    big = os.urandom(6 << 20)  # incompressible: cut into pieces across parts
    archive(arch / "bin.tar.xz", {"site/lib/big.so": big}, "w:xz")
    archive(arch / "py.tar.xz", {"site/pkg/__init__.py": b"X = 1\n"}, "w:xz")
    archive(arch / "extra.tar", {"site/extra.txt": b"plain tar\n"}, "w")
    carry = tmp_path / "carry"
    assert pack(arch, carry).returncode == 0
    return carry, big


def source(vstage, *folders) -> str:
    script = "; ".join(f"source {os.path.join(STAGE, 'stage.sh')} {f}" for f in folders)
    out = subprocess.run(["bash", "-c", script + '; echo "PYTHONPATH=$PYTHONPATH"'],
                         env={**os.environ, "VSTAGE": str(vstage)}, capture_output=True,
                         text=True, check=True)
    return out.stdout


def test_parts_in_any_order_give_the_archives_back(parts, tmp_path):
    carry, big = parts
    folders = sorted(str(p) for p in carry.iterdir())
    assert len(folders) >= 3 and all(
        sum(os.path.getsize(os.path.join(f, n)) for n in os.listdir(f) if n != "MANIFEST")
        <= PART_MIB * 2**20 for f in folders)
    vstage = tmp_path / "vstage"
    for i, folder in enumerate(reversed(folders)):  # one call per part
        out = source(vstage, folder)
        assert ("vstage: READY" in out) == (i == len(folders) - 1), out
    assert (vstage / "site/lib/big.so").read_bytes() == big
    assert (vstage / "site/pkg/__init__.py").read_bytes() == b"X = 1\n"
    assert (vstage / "site/extra.txt").read_bytes() == b"plain tar\n"
    assert f"PYTHONPATH={vstage}/site:" in out
    # a later call with an empty folder re-exports the environment only
    empty = tmp_path / "empty"
    empty.mkdir()
    again = source(vstage, str(empty))
    assert "vstage: READY" in again and f"PYTHONPATH={vstage}/site:" in again


def test_a_damaged_part_is_named_and_not_unpacked(parts, tmp_path):
    carry, _ = parts
    folders = sorted(str(p) for p in carry.iterdir())
    victim = next(os.path.join(f, n) for f in folders for n in os.listdir(f)
                  if n.startswith("py.tar.xz"))
    with open(victim, "r+b") as f:
        f.seek(10)
        f.write(b"\x00\x01")
    out = source(tmp_path / "vstage", *folders)
    assert "SHA-256 MISMATCH py.tar.xz" in out
    assert "still missing: py.tar.xz" in out and "READY" not in out
    assert not (tmp_path / "vstage/site/pkg").exists()


def test_a_carried_jit_cache_is_restored_and_nothing_is_ready_before_a_part(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    archive(folder / "vstage_cache.tar.xz", {"cache/tilelang/k.so": b"kernel"}, "w:xz")
    out = source(tmp_path / "vstage", str(folder))
    assert (tmp_path / "vstage/cache/tilelang/k.so").read_bytes() == b"kernel"
    assert "READY" not in out and "no MANIFEST" in out


def test_packing_again_reads_the_archives_and_an_empty_folder_is_refused(parts, tmp_path):
    carry, _ = parts
    before = sorted(p.name for p in (tmp_path / "arch").iterdir())
    assert pack(tmp_path / "arch", carry, part_mib=4).returncode == 0
    assert sorted(p.name for p in (tmp_path / "arch").iterdir()) == before
    folders = sorted(str(p) for p in carry.iterdir())
    assert "vstage: READY" in source(tmp_path / "vstage", *folders)
    (tmp_path / "none").mkdir()
    refused = pack(tmp_path / "none", carry)
    assert refused.returncode != 0 and "holds no archives" in refused.stderr
    assert sorted(str(p) for p in carry.iterdir()) == folders  # the parts stay
    tiny = pack(tmp_path / "arch", carry, part_mib=1)
    assert tiny.returncode != 0 and "at least 2 MiB" in tiny.stderr
