"""The design's file tree names every module of the core and the glue, and nothing the
repository ships points at files outside it (the design notes a session reads live
beside the repository, not in it)."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"


def test_design_tree_names_every_module():
    """Every module of the core and the glue, and every folder it sits in."""
    tree = DESIGN.read_text().split("```")[1]
    named = set(re.findall(r"\w+\.py", tree)) | set(re.findall(r"(\w+)/", tree))
    missing = []
    for folder in ("hierarchy", "integration", "triton_kernels"):
        for p in (ROOT / "vllm_dhisparse" / folder).rglob("*.py"):
            parts = p.relative_to(ROOT / "vllm_dhisparse").parts
            missing += [x for x in (*parts[:-1], p.name)
                        if x != "__init__.py" and x not in named]
    assert missing == [], f"docs/design.md's tree does not name {sorted(set(missing))}"


def test_no_link_to_files_outside_the_repository():
    shipped = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"),
               *(ROOT / "vllm_dhisparse").rglob("*.py")]
    found = [f"{p.relative_to(ROOT)}:{n}" for p in shipped
             for n, line in enumerate(p.read_text().splitlines(), 1) if "shared/" in line]
    assert found == [], found


def test_readme_config_table_is_the_generated_one():
    """README's config table is ``vllm-dhisparse config --markdown``, row for row."""
    from vllm_dhisparse.config import markdown_table
    text = (ROOT / "README.md").read_text()
    start = "<!-- config table: vllm-dhisparse config --markdown -->\n"
    assert start in text, "README lost its config table markers"
    table = text.split(start, 1)[1].split("\n<!-- end of config table -->", 1)[0]
    assert table == markdown_table(), "README's config table differs from the config: " \
        "paste `vllm-dhisparse config --markdown` between the markers"
