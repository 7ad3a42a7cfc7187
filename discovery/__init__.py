"""discovery"""
