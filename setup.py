"""Which packages the wheel holds: found, not listed. Everything else is in pyproject.toml.

The package ``autopar`` is spread over the repository's top-level folders (README.md, "Repository
layout"), each installed under the name on its left, and the measured reference data ships inside
it as ``autopar.reference_data`` (every ``*.csv`` in ``reference/``; ``autopar.reference.data_path``
finds one). pyproject.toml's ``[tool.setuptools.packages.find]`` cannot put what it finds in a
folder under another package's name, so the packages are found here: each mapped folder and every
folder under it with an ``__init__.py``, so a new subpackage ships without an edit here.
"""

from setuptools import find_packages, setup

PACKAGE_DIR = {
    "autopar": "autopar",
    "autopar.passes": "passes",
    "autopar.cost": "cost",
    "autopar.runtime": "runtime",
    "autopar.reference_data": "reference",
}


def packages() -> list[str]:
    found = []
    for name, folder in PACKAGE_DIR.items():
        found += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]
    return found


setup(package_dir=PACKAGE_DIR, packages=packages(), package_data={"autopar.reference_data": ["*.csv"]})
