"""The one build step pyproject.toml cannot state stably: the codecs' optional
native loops (chunkstore/codecs/_native.c, see chunkstore/codecs/native.py).

``optional=True``: where no C compiler is at hand the install still succeeds and
chunkstore uses the numpy fallbacks, which write and read the same bytes.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("chunkstore.codecs._native", ["chunkstore/codecs/_native.c"],
                             optional=True, extra_compile_args=["-O3"])])
