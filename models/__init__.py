"""specloop.models"""
