"""diloco"""
