"""msakit: MiniMax-M3.1-Flash's system (MSA sparse attention with a KL-trained block indexer,
NVFP4/MXFP8 quantization-aware training, DSpark speculative decoding), fast on Hopper GPUs."""

from msakit.version import __version__  # noqa: F401  (the package version)


def _register_with_transformers() -> None:
    """Once transformers is imported (now or later), register msakit's attention implementation
    and the classes of saved MSA models with it (`msakit.models.hf.register_transformers`),
    so `transformers.AutoModelForCausalLM.from_pretrained` loads them.  transformers is not
    imported here: it is optional and slow to import."""
    import importlib.abc
    import importlib.util
    import sys

    def register() -> None:
        from msakit.models.hf import register_transformers

        register_transformers()

    if "transformers" in sys.modules:
        register()
        return

    class _AfterTransformers(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):  # noqa: ANN001
            if name != "transformers":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_then_register(module) -> None:  # noqa: ANN001
                exec_module(module)
                register()

            spec.loader.exec_module = exec_then_register
            return spec

    sys.meta_path.insert(0, _AfterTransformers())


_register_with_transformers()
