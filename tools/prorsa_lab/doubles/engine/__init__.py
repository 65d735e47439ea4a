"""The SGLang 0.5.23 engine double: its model (:mod:`.model`), HTTP surface (:mod:`.server`),
command line, worker ranks and KV hand-off. :mod:`prorsa_lab.doubles.sglang_double` is
the entry point users import and run.
"""
