"""Packaging for `communities`.

The core install stays light: torch, numpy, scipy, scikit-learn, mpi4py, pyyaml,
pydantic, tqdm, greenlet, psutil. The MPI *library* is the user's choice: on a cluster use the
system MPI that mpi4py was built against; on a laptop or CI the ``[mpich]`` extra
brings a self-contained ``mpiexec`` from PyPI.
"""
from setuptools import find_packages, setup

setup(
    name="communities",
    version="0.1.0",
    description="Decentralized data-parallel PyTorch training over MPI with "
    "hierarchical community-clustered pairwise gossip",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    license_files=["LICENSE"],
    classifiers=[
        "License :: OSI Approved :: BSD License",
        "Programming Language :: Python :: 3",
        "Intended Audience :: Science/Research",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Operating System :: POSIX :: Linux",
    ],
    packages=find_packages(include=["communities", "communities.*"]),
    # templates/slurm.sbatch links to launch/slurm.sbatch, the one batch-script template
    package_data={"communities": ["templates/*.sbatch"]},
    python_requires=">=3.9",
    install_requires=[
        # A lower bound only: users keep the torch build (CUDA/ROCm/CPU) they have.
        "torch>=2.1",
        "numpy>=1.23",
        "scipy>=1.9",
        "scikit-learn>=1.2",
        "mpi4py>=3.1",
        "pyyaml>=6",
        "pydantic>=2.4",
        "omegaconf>=2.1",  # config overrides that merge, ${oc.env:VAR} interpolation (communities/overrides.py)
        "tqdm>=4.60",
        "greenlet>=2.0",  # populations: many replicas per MPI process (runtime/population.py)
        "psutil>=5.9",  # a launched job's processes, to find its ranks and end all of it (tools/jobs.py)
    ],
    extras_require={
        "mpich": ["mpich"],
        # communities inspect; pandas for the notebook API (communities.open_run's frames)
        "inspect": ["matplotlib>=3.6", "pandas>=1.5"],
        "mnist1d": ["mnist1d>=0.0.2"],
        # privacy.enabled: true (DP-SGD's accountant; opacus brings no torch of its own beyond torch>=2.6)
        "privacy": ["opacus>=1.5"],
        # logging.tensorboard: true (torch.utils.tensorboard's writer needs the tensorboard package)
        "tensorboard": ["tensorboard>=2.10"],
        # logging.wandb: true (Weights & Biases; WANDB_MODE=offline on nodes without internet)
        "wandb": ["wandb>=0.17"],
        # logging.mlflow: true; the client alone (mlflow-skinny): the server, if any, runs elsewhere
        "mlflow": ["mlflow-skinny>=2.15"],
        # nbclient, nbformat and ipykernel execute docs/notebooks/ headless (tests/unit/test_notebook_api.py);
        # wandb and mlflow-skinny: tests/unit/test_tracking.py (offline, a file store); pytest-xdist: make test
        # runs tests/unit/ on UNIT_WORKERS processes
        "test": ["pytest>=7", "pytest-timeout>=2.1", "pytest-xdist>=3", "hypothesis>=6", "matplotlib>=3.6",
                 "mnist1d>=0.0.2", "tensorboard>=2.10", "pandas>=1.5", "nbclient>=0.6", "nbformat>=5.1", "ipykernel>=6",
                 "wandb>=0.17", "mlflow-skinny>=2.15"],
        # pinned: a newer linter may flag new things, and CI runs make lint
        "dev": ["ruff==0.17.6", "mypy==2.4.1", "py-spy>=0.3"],
        # the documentation site: mkdocs build --strict (mkdocs.yml); below the next major versions, untried here
        "docs": ["mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10", "pymdown-extensions>=10"],
    },
    entry_points={"console_scripts": ["communities=communities.cli:main"]},
)
