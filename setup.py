"""The one build step pyproject.toml cannot declare: ship the top-level `models.json` in the wheel.

`models.json` (the list of models colembed serves by name) lives at the repository's top level,
the one copy engineers edit. The wheel must hold it as `colembed/models.json` (package data, read
by `colembed.registry`), so `build_py` copies it there in the build folder; nothing is copied in
the source tree (an editable install reads the top-level file itself: `registry.models_json_path`).
MANIFEST.in puts it in the sdist, so a wheel built from the sdist has it too.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

MODELS_JSON = "models.json"


class BuildWithModelList(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:  # editable: the source tree's own top-level file is read
            target = Path(self.build_lib) / "colembed" / MODELS_JSON
            target.parent.mkdir(parents=True, exist_ok=True)
            self.copy_file(str(Path(__file__).with_name(MODELS_JSON)), str(target))

    def get_outputs(self, include_bytecode=True):
        extra = [] if self.editable_mode else [str(Path(self.build_lib) / "colembed" / MODELS_JSON)]
        return super().get_outputs(include_bytecode) + extra


setup(cmdclass={"build_py": BuildWithModelList})
