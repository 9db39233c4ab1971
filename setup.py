"""The one build step pyproject.toml cannot state stably: the optional native
byte-plane loops (chunkstore/codecs/_planes.c, see chunkstore/codecs/planes.py).

``optional=True``: where no C compiler is at hand the install still succeeds and
chunkstore uses the numpy fallback, which writes and reads the same bytes.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("chunkstore.codecs._planes", ["chunkstore/codecs/_planes.c"],
                             optional=True, extra_compile_args=["-O3"])])
