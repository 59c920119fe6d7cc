"""Certification of losslessness: the chi-square test against exact laws and its verdicts
(:mod:`verispec.certify.core`), the exact laws of models small enough to enumerate
(:mod:`verispec.certify.exact`), toy Markov-chain models (:mod:`verispec.certify.toy`) and tiny
transformers built in code (:mod:`verispec.certify.tiny`).
"""
