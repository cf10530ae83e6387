#!/bin/bash
echo separate > /app/result.txt
echo "not an artifact" > /app/not-handed.txt
