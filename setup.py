"""megatron-parm: Parm's MoE dispatchers (arXiv 2407.00599) as a Megatron-Core plug-in."""

from setuptools import find_packages, setup

setup(
    name="megatron-parm",
    version="0.1.0",
    description="Parm's dedicated MoE schedules as token dispatchers for Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_parm", "megatron_parm.*"]),
    # The performance model's shipped cluster profiles (the automatic dispatcher's defaults).
    package_data={"megatron_parm.perf_model": ["profiles/*.yaml"]},
    python_requires=">=3.10",
    install_requires=[
        # megatron-core 0.17+ needs Python 3.12; 0.16.1 has the six-phase dispatcher API.
        "megatron-core==0.16.1",
        "torch>=2.13.0",
        "numpy",
        "pyyaml",
        "sentencepiece",
        "psutil",  # megatron-core's checkpoint saving
    ],
    extras_require={
        # Used where installed, never required.
        "te": ["transformer-engine"],
        "apex": ["apex"],
        "test": ["pytest"],
    },
)
