"""The SGLang 0.5.23 engine double: its model (:mod:`.model`), HTTP surface (:mod:`.server`),
command line, worker ranks and KV hand-off. :mod:`prorsa_lab.doubles.sglang_double` is
the one path to it: what users import and run (an import contract keeps every other
module out of this package).
"""
