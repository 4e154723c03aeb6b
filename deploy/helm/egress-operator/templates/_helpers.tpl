{{/* The labels every object of the chart carries: deploy/default's, and Helm's own. */}}
{{- define "egress-operator.labels" -}}
app.kubernetes.io/part-of: egress-operator
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{/* The operator's pods: the Deployment's selector, the PDB's and the Services'. */}}
{{- define "egress-operator.selector" -}}
app.kubernetes.io/name: egress-operator
{{- end }}

{{/* The gateway's pods: its Deployment's selector, its PDB's and its Services'. */}}
{{- define "egress-operator.gatewaySelector" -}}
app.kubernetes.io/name: egress-gateway
{{- end }}

{{/* The image reference. */}}
{{- define "egress-operator.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The name of the tokens Secret the pods mount. */}}
{{- define "egress-operator.tokensSecret" -}}
{{ .Values.discoveryTokens.existingSecret | default "egress-operator-discovery-tokens" }}
{{- end }}
