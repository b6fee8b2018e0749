"""Math environment: single-turn answers or multi-turn with a calculator tool, answers checked
with math-verify in a bounded worker process, readers for GSM8K, MATH-500, AIME 2024/2025 and
AMC 2023, and a generated `arithmetic` task family the embedded tiny model can learn.

Import from the modules themselves; the package imports nothing, so importing one part does
not load the others (`verify` starts worker processes that import only math-verify).
"""
