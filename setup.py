"""Maps the repository's top-level folders into the `lockstep.*` import namespace.

The folders stay short at the repository root (framework/, kernels/, ...) but are never importable
as top-level names: `kernels` is a PyPI package and would be shadowed. Each root becomes
`lockstep.<root>` and every folder under it a subpackage (config-group folders hold only YAML,
hence the namespace-package discovery).
"""
from setuptools import find_namespace_packages, setup

ROOTS = ["framework", "kernels", "launch", "configs", "recipes"]

packages, package_dir = [], {}
for root in ROOTS:
    for sub in [""] + find_namespace_packages(root, exclude=["*__pycache__*"]):
        name = f"lockstep.{root}" + (f".{sub}" if sub else "")
        packages.append(name)
        package_dir[name] = root + ("/" + sub.replace(".", "/") if sub else "")

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={
        "lockstep.configs": ["**/*.yaml"],
        "lockstep.recipes": ["*.yaml"],
        "lockstep.framework.data": ["tasks/*.jsonl"],
    },
)
