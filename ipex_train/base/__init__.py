"""(layer package)"""
